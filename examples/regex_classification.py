"""Regex-constrained classification: the answer can only be one of the labels.

    python examples/regex_classification.py [--model DIR]
"""
from __future__ import annotations

import argparse

REVIEWS = [
    "The battery lasts two days and the screen is gorgeous.",
    "Arrived broken, support never answered.",
    "It is a phone. It makes calls.",
]
LABELS = r"(positive|negative|neutral)"


def main(argv=None, llm=None) -> list[str]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--max-tokens", type=int, default=8)
    args = ap.parse_args(argv)

    from deepinfer_sg import LLM, Regex, SamplingParams
    llm = llm or LLM(args.model)
    prompts = [f"Review: {r}\nSentiment (positive, negative or neutral):" for r in REVIEWS]
    outs = llm.generate(prompts, SamplingParams(max_tokens=args.max_tokens, temperature=0.0), constraint=Regex(LABELS))
    labels = [o.text for o in outs]
    for review, label in zip(REVIEWS, labels):
        print(f"{label:>8}  {review}")
    return labels


if __name__ == "__main__":
    main()
