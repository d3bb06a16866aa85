"""pytest plugin: the two hub tokenizers upstream's LLM objectives tests load, built in code.

The tests call ``AutoTokenizer.from_pretrained`` for "Qwen/Qwen2.5-0.5B" and
"facebook/opt-125m", which downloads; CI and this project's machines cannot. This plugin
answers those two names with a byte-level tokenizer (every string encodes, and decodes back
unchanged) carrying the real models' special tokens; any other name goes to transformers as
before (run with HF_HUB_OFFLINE=1, so that nothing downloads unnoticed). The tests build
their models from configs, so only the tokenizers are needed. No chat template: torchrl picks
its own template from the tokenizer's ``name_or_path``, or the tests name one.
"""

from tokenizers import decoders, models, pre_tokenizers, processors, Tokenizer
from transformers import AutoTokenizer, PreTrainedTokenizerFast

# name -> (special tokens, in id order, from id 0; the tokenizer's named special tokens).
# OPT's GPT-2 vocabulary starts with its four specials and it uses "</s>" as bos and eos;
# Qwen2.5 has no bos and pads with its end-of-text token.
_SPECS = {
    "facebook/opt-125m": (
        ["<s>", "<pad>", "</s>", "<unk>"],
        {
            "bos_token": "</s>",
            "eos_token": "</s>",
            "pad_token": "<pad>",
            "unk_token": "</s>",
        },
    ),
    "Qwen/Qwen2.5-0.5B": (
        ["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        {"eos_token": "<|endoftext|>", "pad_token": "<|endoftext|>"},
    ),
}


def build(name):
    """A fresh tokenizer for ``name`` (fresh because the tests set its pad token and template)."""
    specials, named = _SPECS[name]
    # BPE without merges over the 256 byte symbols: one token per byte, nothing unknown.
    # Sorted: alphabet() comes in no fixed order, and every process must agree on the ids.
    byte_symbols = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {tok: i for i, tok in enumerate(specials + byte_symbols)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    if "bos_token" in named:  # OPT's tokenizer puts its bos before every sequence
        bos = named["bos_token"]
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A",
            pair=f"{bos} $A {bos} $B",
            special_tokens=[(bos, vocab[bos])],
        )
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, name_or_path=name, **named)
    fast.add_special_tokens({"additional_special_tokens": specials})  # never split them
    return fast


def pytest_configure(config):
    # Patched in every process (xdist workers load the plugin too).
    original = AutoTokenizer.from_pretrained

    def from_pretrained(name, *args, **kwargs):
        if name in _SPECS:
            return build(name)
        return original(name, *args, **kwargs)

    AutoTokenizer.from_pretrained = from_pretrained
