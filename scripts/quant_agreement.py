"""How often a quantized checkpoint's greedy tokens are the float checkpoint's: the same prompts
through both (tp 1, the CPU), and per prompt whether its tokens are the same and how many of the
first ones are.

    python scripts/quant_agreement.py FLOAT_DIR QUANTIZED_DIR [QUANTIZED_DIR ...] --prompts 64 --tokens 32

The prompts are chat questions built from a few templates (the demo model answers them in English).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

SUBJECTS = ["France", "Japan", "Brazil", "Egypt", "Canada", "India", "Italy", "Kenya"]
QUESTIONS = ["What is the capital of {}?", "Name a river in {}.", "What language is spoken in {}?",
             "Describe the weather in {} in one sentence.", "What food is {} known for?",
             "Write a short poem about {}.", "How many people live in {}?", "What is a famous landmark in {}?"]


def prompts(n: int) -> list[str]:
    return [QUESTIONS[i % len(QUESTIONS)].format(SUBJECTS[i // len(QUESTIONS) % len(SUBJECTS)]) for i in range(n)]


def greedy(model: Path, texts: list[str], tokens: int) -> list[list[int]]:
    from msinfer.launcher.api import LLM
    llm = LLM(str(model), max_model_len=256, max_batch_size=64, device="cpu")
    try:
        out = llm.generate(texts, {"max_new_tokens": tokens, "ignore_eos": True})
    finally:
        llm.shutdown()
    return [r["output_token_ids"] for r in out]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("float_model", type=Path)
    ap.add_argument("quantized", type=Path, nargs="+")
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=32)
    args = ap.parse_args()
    texts = prompts(args.prompts)
    ref = greedy(args.float_model, texts, args.tokens)
    for path in args.quantized:
        got = greedy(path, texts, args.tokens)
        same = sum(a == b for a, b in zip(ref, got))
        prefix = [next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a)) for a, b in zip(ref, got)]
        print(json.dumps({"model": str(path), "prompts": len(texts), "tokens": args.tokens,
                          "identical": same, "mean_common_prefix": round(sum(prefix) / len(prefix), 2),
                          "first_token_same": sum(p > 0 for p in prefix)}))


if __name__ == "__main__":
    sys.exit(main())
