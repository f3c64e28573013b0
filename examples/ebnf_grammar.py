"""An EBNF grammar: arithmetic expressions that always parse.

    python examples/ebnf_grammar.py [--model DIR] [--max-tokens 24]
"""
from __future__ import annotations

import argparse

ARITHMETIC = r"""
root   ::= expr
expr   ::= term (("+" | "-") term)*
term   ::= factor (("*" | "/") factor)*
factor ::= number | "(" expr ")"
number ::= [0-9] | [1-9] [0-9] | [1-9] [0-9] [0-9]
"""


def main(argv=None, llm=None) -> list:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--max-tokens", type=int, default=24)
    args = ap.parse_args(argv)

    from deepinfer_sg import LLM, Grammar, SamplingParams
    llm = llm or LLM(args.model)
    prompts = ["Write an arithmetic expression:", "Compute something:"]
    outs = llm.generate(prompts, SamplingParams(max_tokens=args.max_tokens, temperature=0.8, seed=1),
                        constraint=Grammar(ARITHMETIC, syntax="ebnf"))
    for o in outs:
        # "length" means max_tokens cut the expression; every prefix is still a prefix of a valid one
        print(f"{o.finish_reason:>20}  {o.text}")
    return outs


if __name__ == "__main__":
    main()
