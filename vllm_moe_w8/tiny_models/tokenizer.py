"""A small byte-level BPE tokenizer trained offline on a built-in text, with a chat template.
"""

from __future__ import annotations

import json
from pathlib import Path

TOKENIZER_VOCAB = 512
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>",
                  "<|image_pad|>", "<|video_pad|>"]
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{%- if message['content'] is string %}{%- set content = message['content'] %}"
    "{%- else %}{%- set content = message['content'] | map(attribute='text') | join('') %}{%- endif %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + content + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

TRAINING_TEXT = """\
Mixture of experts models route every token to a few experts out of many. Each expert is a small
feed forward network with a gate projection, an up projection and a down projection. The router
scores the experts with a softmax or a sigmoid, picks the top k, and the layer returns the weighted
sum of the chosen experts. Weights stored in eight bit floating point take one byte per parameter,
half of what bfloat16 needs, so a server can keep twice as many experts in memory. The scale of a
block of one hundred and twenty eight by one hundred and twenty eight weights turns the bytes back
into real numbers. Trainium has its own eight bit format whose largest value is two hundred and
forty, while the open format reaches four hundred and forty eight. Halving a block and doubling its
scale keeps the product the same. The quick brown fox jumps over the lazy dog. Hello, world! How
are you today? I am fine, thank you. What is the capital of France? Paris is the capital of France.
Tell me a story about a robot who learns to paint. Once upon a time there was a small robot in a
quiet town by the sea. It watched the sky every evening and tried to mix the colours of the sunset.
Numbers: 0 1 2 3 4 5 6 7 8 9 10 42 100 128 256 448 1024. Code: def main(): return 0; print(x + y).
"""


def write_tokenizer(path: str | Path, vocab_size: int = TOKENIZER_VOCAB) -> dict:
    """Train a byte-level BPE on TRAINING_TEXT and write tokenizer.json + tokenizer_config.json.

    Returns the ids of the special tokens (``bos``, ``eos`` list, ``pad``, vision tokens) and ``size``.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    path = Path(path)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([TRAINING_TEXT] * 4, trainer=trainer)
    tok.save(str(path / "tokenizer.json"))
    ids = {t: tok.token_to_id(t) for t in SPECIAL_TOKENS}
    cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "add_bos_token": False,
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "model_max_length": 4096,
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
        "added_tokens_decoder": {
            str(ids[t]): {"content": t, "lstrip": False, "normalized": False, "rstrip": False,
                          "single_word": False, "special": True}
            for t in SPECIAL_TOKENS
        },
    }
    (path / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2))
    (path / "special_tokens_map.json").write_text(json.dumps({"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}, indent=2))
    return {
        "bos": ids["<|endoftext|>"],
        "eos": [ids["<|im_end|>"], ids["<|endoftext|>"]],
        "pad": ids["<|endoftext|>"],
        "vision_start": ids["<|vision_start|>"],
        "vision_end": ids["<|vision_end|>"],
        "image_pad": ids["<|image_pad|>"],
        "video_pad": ids["<|video_pad|>"],
        "size": tok.get_vocab_size(),
    }
