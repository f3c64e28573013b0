"""A tool-calling agent loop: DSML tool calls, each argument typed by its tool's JSON Schema, executed here.

    python examples/tool_agent.py [--model DIR] [--turns 3] [--max-tokens 80]

Each turn: render the conversation with DeepSeek's encoding (deepseek-recipe), generate under the DSML
grammar of the declared tools, parse the completion back into an OpenAI-style message, run every tool call,
append the results as tool messages, and continue until the model answers without calling a tool.
"""
from __future__ import annotations

import argparse
import json

TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "Current weather for a city",
        "parameters": {"type": "object", "properties": {
            "city": {"type": "string", "maxLength": 30},
            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
            "required": ["city"], "additionalProperties": False}}},
    {"type": "function", "function": {
        "name": "add", "description": "Add numbers",
        "parameters": {"type": "object", "properties": {
            "numbers": {"type": "array", "items": {"type": "number"}, "minItems": 1, "maxItems": 4}},
            "required": ["numbers"], "additionalProperties": False}}},
]


def get_weather(city: str, unit: str = "celsius") -> dict:
    temp_c = (sum(map(ord, city)) % 35) - 5  # a deterministic stand-in for a weather service
    return {"city": city, "temperature": temp_c if unit == "celsius" else temp_c * 9 / 5 + 32, "unit": unit}


def add(numbers: list) -> dict:
    return {"sum": sum(numbers)}


IMPLEMENTATIONS = {"get_weather": get_weather, "add": add}


def run_tool(call: dict) -> str:
    fn = IMPLEMENTATIONS[call["function"]["name"]]
    try:
        return json.dumps(fn(**json.loads(call["function"]["arguments"])), ensure_ascii=False)
    except Exception as e:  # a tool failure goes back to the model as the result, the loop continues
        return json.dumps({"error": f"{type(e).__name__}: {e}"})


def main(argv=None, llm=None) -> list:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=80)
    args = ap.parse_args(argv)

    from deepinfer_sg import LLM
    llm = llm or LLM(args.model)
    messages = [{"role": "user", "content": "What is the weather in Lisbon, and what is 2 + 40?"}]
    for turn in range(args.turns):
        # The first turn must call a tool ("required"); later turns may answer in text ("auto").
        response = llm.chat(messages, tools=TOOLS, tool_choice="required" if turn == 0 else "auto",
                        thinking=False, max_tokens=args.max_tokens, seed=turn)
        message = response["choices"][0]["message"]
        messages.append({k: v for k, v in message.items() if k in ("role", "content", "tool_calls")})
        calls = message.get("tool_calls") or []
        print(f"turn {turn}: {len(calls)} tool call(s); content={message.get('content')!r}")
        if not calls:
            break
        for call in calls:
            result = run_tool(call)
            print(f"   {call['function']['name']}({call['function']['arguments']}) -> {result}")
            messages.append({"role": "tool", "tool_call_id": call["id"], "content": result})
    return messages


if __name__ == "__main__":
    main()
