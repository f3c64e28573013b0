"""Invoice extraction with a pydantic model: every output is a valid `Invoice` or a structured error.

    python examples/invoice_extraction.py [--max-tokens 200] [--model DIR]

The same job from the command line, over a JSONL file, resumable:
    deepinfer-sg extract --schema examples.invoice_extraction:Invoice \
        --input deepinfer_sg/data/invoices.jsonl --output invoices.out.jsonl

With the built-in default model (tiny, random weights) the values are nonsense, but each one follows the
schema as far as it got; raise --max-tokens to let every record finish.
"""

import argparse
import json
from importlib import resources
from typing import Literal, Optional

from pydantic import BaseModel, Field


class LineItem(BaseModel):
    description: str = Field(max_length=60)
    quantity: int = Field(ge=1)
    unit_price: float = Field(ge=0)


class Invoice(BaseModel):
    invoice_number: str = Field(max_length=20)
    vendor: str = Field(max_length=60)
    date: Optional[str] = Field(default=None, pattern=r"^[0-9]{4}-[0-9]{2}-[0-9]{2}$")
    currency: Literal["EUR", "USD", "GBP", "JPY", "CHF"]
    total: float = Field(ge=0)
    line_items: list[LineItem] = Field(default_factory=list, max_length=5)


def load_documents(limit: int) -> list[dict]:
    text = resources.files("deepinfer_sg").joinpath("data/invoices.jsonl").read_text(encoding="utf-8")
    return [json.loads(line) for line in text.splitlines() if line.strip()][:limit]


def main(argv=None, llm=None) -> list:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--max-tokens", type=int, default=200)
    ap.add_argument("--docs", type=int, default=3)
    ap.add_argument("--model", default=None)
    args = ap.parse_args(argv)

    from deepinfer_sg import LLM, SamplingParams
    llm = llm or LLM(args.model)
    docs = load_documents(args.docs)
    prompts = [f"Extract the invoice as JSON.\n\n{d['text']}\n\nJSON:" for d in docs]
    outs = llm.generate(prompts, SamplingParams(max_tokens=args.max_tokens, temperature=0.0), output_type=Invoice)
    for doc, out in zip(docs, outs):
        if out.parsed is not None:
            print(doc["id"], "->", out.parsed.model_dump_json())
        else:  # e.g. max_tokens reached before the JSON closed: the raw text and the reason, never an exception
            print(doc["id"], "-> error:", out.parse_error["type"], "| text so far:", out.text[:80])
    return outs


if __name__ == "__main__":
    main()
