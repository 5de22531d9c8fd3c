"""Regenerate trl_prefix_sharing/data/demo_preferences.jsonl: arithmetic word problems behind a long few-shot prompt
(prompt about 8x longer than each answer, the regime where prefix sharing pays). Deterministic.

    python scripts/make_demo_dataset.py
"""

import json
import random
from pathlib import Path


NAMES = ["Ann", "Ben", "Cleo", "Dan", "Eva", "Finn", "Gus", "Hana", "Ivo", "Jade", "Kai", "Lena"]
ITEMS = ["apples", "pens", "books", "coins", "shells", "cards", "stamps", "marbles", "cups", "kites"]
OUT = Path(__file__).resolve().parent.parent / "trl_prefix_sharing" / "data" / "demo_preferences.jsonl"


def problem(rng):
    name, item = rng.choice(NAMES), rng.choice(ITEMS)
    a, b = rng.randint(2, 40), rng.randint(2, 40)
    if rng.random() < 0.5:
        text = f"{name} has {a} {item} and gets {b} more . How many {item} does {name} have now ?"
        answer, op = a + b, "plus"
    else:
        a, b = max(a, b), min(a, b)
        text = f"{name} has {a} {item} and gives away {b} . How many {item} does {name} have left ?"
        answer, op = a - b, "minus"
    return name, item, a, b, op, answer, text


def solution(name, item, a, b, op, value):
    return f"{name} has {a} {op} {b} {item} , that is {value} {item} . The answer is {value} ."


def main(n=96, shots=4, seed=0):
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        lines = ["Solve each problem step by step and give the answer at the end ."]
        for _ in range(shots):
            name, item, a, b, op, answer, text = problem(rng)
            lines.append(f"Question : {text} Answer : {solution(name, item, a, b, op, answer)}")
        name, item, a, b, op, answer, text = problem(rng)
        lines.append(f"Question : {text} Answer :")
        wrong = answer + rng.choice([-3, -2, -1, 1, 2, 3])
        rows.append(
            {
                "prompt": " ".join(lines),
                "chosen": " " + solution(name, item, a, b, op, answer),
                "rejected": " " + solution(name, item, a, b, op, wrong),
            }
        )
    OUT.write_text("".join(json.dumps(row) + "\n" for row in rows))
    print(f"wrote {len(rows)} examples to {OUT}")


if __name__ == "__main__":
    main()
