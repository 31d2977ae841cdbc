"""A tiny Llama and its tokenizer, made locally: the model the vLLM tests, ``qlm profile`` on
CPU and ``make demo BACKEND=vllm`` serve when no model hub can be reached.

2 layers, hidden 128, 4 heads of 32 (vLLM's CPU attention kernels need head_dim >= 32), 2 KV
heads, a byte-level BPE vocabulary of 512 trained on a built-in text, random weights from a
fixed seed. Its output is meaningless but deterministic, which is what the tests need: greedy
decoding of the same prompt gives the same tokens every time.

Needs ``torch``, ``transformers`` and ``tokenizers`` (installed with vllm).
"""

from __future__ import annotations

import json
from pathlib import Path

VOCAB_SIZE = 512
MAX_POSITIONS = 2048
SEED = 0

# Training text for the tokenizer: enough variety that common English words get merges.
_CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "A queue manager orders requests so that each one meets its deadline.",
    "Large language models generate one token at a time, and batching shares the GPU.",
    "Interactive chat requests need answers in seconds; batch jobs can wait for hours.",
    "The coordinator plans virtual queues; agents pull requests and run them on engines.",
    "When the plan changes, a running request can be evicted and resumed later exactly.",
    "Model weights can sleep in host memory and wake quickly when the next group needs them.",
    "0 1 2 3 4 5 6 7 8 9 10 100 1000 ( ) [ ] { } , . ; : ! ? - + * / = < > ' \"",
]


def make_tiny_model(path: str | Path, *, overwrite: bool = False) -> Path:
    """Write the model (``config.json``, weights) and tokenizer into ``path``; return it.
    An existing complete model there is reused unless ``overwrite``."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    out = Path(path)
    marker = out / "qlm-tiny-model.json"
    if marker.exists() and not overwrite:
        return out
    out.mkdir(parents=True, exist_ok=True)

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=["<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS * 4, trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")
    fast.save_pretrained(out)

    torch.manual_seed(SEED)
    config = LlamaConfig(
        vocab_size=tok.get_vocab_size(),
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=MAX_POSITIONS,
        bos_token_id=fast.bos_token_id,
        eos_token_id=fast.eos_token_id,
        dtype="float32",
        tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(config)
    model.save_pretrained(out, safe_serialization=True)
    marker.write_text(json.dumps({"vocab_size": config.vocab_size, "seed": SEED}) + "\n")
    return out


def main() -> None:
    import sys

    target = sys.argv[1] if len(sys.argv) > 1 else ".qlm/tiny-llama"
    print(make_tiny_model(target))


if __name__ == "__main__":
    main()
