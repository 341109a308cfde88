"""The bundled demo: generated conversations a tiny model can learn, a tokenizer trained on them, a tiny Llama.

Four skills, each with a short, checkable answer, so exact match on held-out prompts shows learning:
  - single-digit addition, sometimes as a second turn;
  - reversing a short lowercase word;
  - looking up a capital from a fixed table;
  - a toy tool call (`get_weather` with the city from the question), answered after the tool result.
Nothing is downloaded.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from sftflow.tasks.core.atomic import atomic_writer
from sftflow.tasks.tiny import train_tokenizer

CAPITALS = {
    "France": "Paris",
    "Japan": "Tokyo",
    "Italy": "Rome",
    "Spain": "Madrid",
    "Egypt": "Cairo",
    "Peru": "Lima",
    "Kenya": "Nairobi",
    "Norway": "Oslo",
    "Chile": "Santiago",
    "Canada": "Ottawa",
    "Greece": "Athens",
    "Cuba": "Havana",
}
CITIES = ["Paris", "Tokyo", "Rome", "Madrid", "Cairo", "Lima", "Oslo", "Athens"]
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather for a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
SYSTEM_PROMPTS = ["You are a helpful assistant.", "Answer briefly.", "You are a precise assistant."]


def _addition(rng: random.Random) -> list[dict]:
    a, b = rng.randrange(10), rng.randrange(10)
    messages = [{"role": "user", "content": f"What is {a} + {b}?"}, {"role": "assistant", "content": str(a + b)}]
    if rng.random() < 0.3:
        c = rng.randrange(10)
        messages += [
            {"role": "user", "content": f"And {a + b} + {c}?"},
            {"role": "assistant", "content": str(a + b + c)},
        ]
    return messages


def _reverse(rng: random.Random) -> list[dict]:
    word = "".join(rng.choice("abcdefgh") for _ in range(rng.randint(3, 4)))
    return [{"role": "user", "content": f"Reverse {word}"}, {"role": "assistant", "content": word[::-1]}]


def _capital(rng: random.Random) -> list[dict]:
    country = rng.choice(sorted(CAPITALS))
    return [
        {"role": "user", "content": f"Capital of {country}?"},
        {"role": "assistant", "content": CAPITALS[country]},
    ]


def _tool_call(rng: random.Random) -> list[dict]:
    city = rng.choice(CITIES)
    degrees = rng.randint(5, 30)
    call = {"id": "call_0", "type": "function", "function": {"name": "get_weather", "arguments": {"city": city}}}
    return [
        {"role": "user", "content": f"Weather in {city}?"},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "content": json.dumps({"city": city, "celsius": degrees})},
        {"role": "assistant", "content": f"{degrees} C in {city}"},
    ]


SKILLS = [_addition, _reverse, _capital, _tool_call]


def make_conversations(n: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    records = []
    for i in range(n):
        skill = SKILLS[i % len(SKILLS)]
        messages = skill(rng)
        if rng.random() < 0.5:
            messages = [{"role": "system", "content": rng.choice(SYSTEM_PROMPTS)}, *messages]
        record: dict = {"messages": messages}
        if skill is _tool_call:
            record["tools"] = [WEATHER_TOOL]
        records.append(record)
    return records


# The demo's benchmark tasks: questions in the training data's own phrasing, so the tuned model can answer them.
DEMO_BENCH = {
    "arithmetic": {"name": "arithmetic", "kind": "generate", "answer_pattern": r"-?\d+", "max_new_tokens": 8},
    "capitals": {"name": "capitals", "kind": "choice"},
}


def write_demo_bench(out_dir: str | Path, seed: int = 1) -> dict[str, Path]:
    """`arithmetic.jsonl` (24 additions, answered by generation) and `capitals.jsonl` (each country of the table with
    four capitals to choose from)."""
    rng = random.Random(seed)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    pairs = rng.sample([(a, b) for a in range(10) for b in range(10)], 24)
    arithmetic = [{"question": f"What is {a} + {b}?", "answer": str(a + b)} for a, b in pairs]
    capitals = []
    for country, capital in sorted(CAPITALS.items()):
        choices = [capital, *rng.sample(sorted(set(CAPITALS.values()) - {capital}), 3)]
        rng.shuffle(choices)
        capitals.append({"question": f"Capital of {country}?", "choices": choices, "answer": choices.index(capital)})
    paths = {}
    for name, items in (("arithmetic", arithmetic), ("capitals", capitals)):
        paths[name] = out / f"{name}.jsonl"
        with atomic_writer(paths[name], "w", encoding="utf-8") as f:
            f.writelines(json.dumps(item, sort_keys=True) + "\n" for item in items)
    return paths


def write_demo(out_dir: str | Path, n: int = 4000, seed: int = 0, vocab_size: int = 384) -> dict[str, Path]:
    """Write `conversations.jsonl` and a `tokenizer/` folder trained on the rendered-ish text of the conversations."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    records = make_conversations(n, seed)
    data_path = out / "conversations.jsonl"
    with atomic_writer(data_path, "w", encoding="utf-8") as f:
        for record in records:
            f.write(json.dumps(record, sort_keys=True) + "\n")
    # The tokenizer sees the raw JSON lines: every role name, digit, word and tool-call brace appears there.
    tokenizer_dir = out / "tokenizer"
    if not (tokenizer_dir / "tokenizer.json").is_file():
        texts = [json.dumps(r, sort_keys=True) for r in records]
        train_tokenizer(texts, tokenizer_dir, vocab_size=vocab_size)
    return {"data": data_path, "tokenizer": tokenizer_dir}
