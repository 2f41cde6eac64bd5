"""Does an uncertainty score tell right answers from wrong ones? On tasks the bundled model can
be graded on by a rule (two-digit additions and products, capitals, a multiple-choice set written
here), each question decoded greedily with --uncertainty; per score, the AUROC of the score for
an answer being wrong and LM-Polygraph's prediction-rejection ratio (PRR: the area between the
accuracy-rejection curve and random rejection, over the oracle's), each with a 95% bootstrap
interval over the questions. DeepConf's confidences are negated (higher: more uncertain).
Writes the table (Markdown) and the raw figures to --out as they come.
Usage: python bench/uncertainty.py [--questions 40] [--boot 1000] [--out bench-uncertainty.json]"""

from __future__ import annotations

import argparse
import json
import random
import re

import lmtrace
from lmtrace.files import write_atomic
from lmtrace.scoring.uncertainty import polygraph

CAPITALS = {"France": "Paris", "Japan": "Tokyo", "Italy": "Rome", "Spain": "Madrid", "Germany": "Berlin",
            "Egypt": "Cairo", "Canada": "Ottawa", "Australia": "Canberra", "Brazil": "Brasilia", "Kenya": "Nairobi",
            "Norway": "Oslo", "Peru": "Lima", "Greece": "Athens", "Poland": "Warsaw", "Turkey": "Ankara",
            "Portugal": "Lisbon", "Sweden": "Stockholm", "Chile": "Santiago", "Cuba": "Havana",
            "Iran": "Tehran"}  # fmt: skip
CHOICES = [
    ("Which is a mammal? A) shark B) dolphin C) trout", "B"),
    ("Which is a planet? A) Mars B) Sirius C) Moon", "A"),
    ("Water boils at sea level at: A) 50 C B) 100 C C) 150 C", "B"),
    ("Which is a prime? A) 9 B) 15 C) 7", "C"),
    ("The largest ocean: A) Atlantic B) Pacific C) Indian", "B"),
    ("Which is a colour? A) red B) dog C) run", "A"),
]
SCORES = ["pmi", "cpmi", "PTrue", "msp", "mean_nll", "perplexity", "mean_entropy", "max_entropy", "renyi_neg",
          "fisher_rao",
          "deepconf.mean", "deepconf.bottom10", "deepconf.lowest_group", "deepconf.tail"]  # fmt: skip


def questions(n: int, rng: random.Random) -> list[tuple[str, str, str]]:
    """(task, prompt, expected) for arithmetic, capitals and the multiple-choice set."""
    out = []
    for _ in range(n):
        a, b = rng.randint(10, 99), rng.randint(10, 99)
        if rng.random() < 0.5:
            out.append(("add", f"What is {a} + {b}? Answer with the number only.", str(a + b)))
        else:
            out.append(("mul", f"What is {a} * {b}? Answer with the number only.", str(a * b)))
    out += [("capital", f"What is the capital of {c}? Answer with the city only.", v) for c, v in CAPITALS.items()]
    out += [("choice", f"{q} Answer with the letter only.", letter) for q, letter in CHOICES]
    return out


def correct(task: str, text: str, expected: str) -> bool:
    if task in ("add", "mul"):
        found = re.search(r"-?\d[\d,]*", text)
        return found is not None and found.group(0).replace(",", "") == expected
    if task == "choice":
        found = re.search(r"\b([ABC])\b", text)
        return found is not None and found.group(1) == expected
    return expected.lower() in text.lower()


def score_of(u: dict, name: str) -> float:
    if name in ("pmi", "cpmi", "PTrue"):  # the extra passes (lmtrace.scoring.uncertainty.polygraph)
        return u["extra"]["p_true"]["PTrue"] if name == "PTrue" else u["extra"][name]
    if name.startswith("deepconf."):
        return -u["deepconf"][name.split(".")[1]]  # a confidence: negated to an uncertainty
    return u[name]


def auroc(unc: list[float], wrong: list[bool]) -> float | None:
    """P(a wrong answer's uncertainty > a right one's), ties half."""
    pos = [u for u, w in zip(unc, wrong) if w]
    neg = [u for u, w in zip(unc, wrong) if not w]
    if not pos or not neg:
        return None
    wins = sum((p > q) + 0.5 * (p == q) for p in pos for q in neg)
    return wins / (len(pos) * len(neg))


def _rejection_area(order: list[int], right: list[bool]) -> float:
    """Mean accuracy of the kept answers, rejecting the most uncertain first, over rejection rates."""
    n = len(order)
    return sum(sum(right[i] for i in order[: n - r]) / (n - r) for r in range(n)) / n


def prr(unc: list[float], wrong: list[bool]) -> float | None:
    right = [not w for w in wrong]
    n = len(unc)
    base = sum(right) / n
    model = _rejection_area(sorted(range(n), key=lambda i: unc[i]), right)
    oracle = _rejection_area(sorted(range(n), key=lambda i: not right[i]), right)
    return None if oracle == base else (model - base) / (oracle - base)


def interval(fn, unc: list[float], wrong: list[bool], boot: int, rng: random.Random) -> tuple:
    values = []
    for _ in range(boot):
        pick = [rng.randrange(len(unc)) for _ in unc]
        v = fn([unc[i] for i in pick], [wrong[i] for i in pick])
        if v is not None:
            values.append(v)
    values.sort()
    if not values:
        return (None, None)
    return (values[int(0.025 * len(values))], values[min(len(values) - 1, int(0.975 * len(values)))])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--questions", type=int, default=40, help="arithmetic questions (capitals and choices added)")
    ap.add_argument("--boot", type=int, default=1000)
    ap.add_argument("--out", default="bench-uncertainty.json")
    a = ap.parse_args()
    rng = random.Random(0)
    qs = questions(a.questions, rng)
    lm = lmtrace.load()
    traces = []
    for start in range(0, len(qs), 16):  # batches of 16 prompts, greedy
        chunk = qs[start : start + 16]
        traces += lmtrace.generate(lm, [q[1] for q in chunk], chat=True, temperature=0, max_new_tokens=12,
                                   uncertainty=lmtrace.Uncertainty(window=4, tail=4))  # fmt: skip
    for (_, prompt, _), tr in zip(qs, traces):
        tr.uncertainty["extra"] = polygraph.estimate(lm, tr, question=prompt)
    wrong = [not correct(t, tr.text, e) for (t, _, e), tr in zip(qs, traces)]
    rows = []
    for name in SCORES:
        unc = [score_of(tr.uncertainty, name) for tr in traces]
        rows.append({"score": name, "auroc": auroc(unc, wrong), "auroc_95": interval(auroc, unc, wrong, a.boot, rng),
                     "prr": prr(unc, wrong), "prr_95": interval(prr, unc, wrong, a.boot, rng)})  # fmt: skip
    found = {"questions": len(qs), "accuracy": 1 - sum(wrong) / len(wrong), "by_task": {}, "rows": rows,
             "answers": [{"task": q[0], "prompt": q[1], "expected": q[2], "text": tr.text, "wrong": w}
                         for q, tr, w in zip(qs, traces, wrong)]}  # fmt: skip
    for task in ("add", "mul", "capital", "choice"):
        ws = [w for q, w in zip(qs, wrong) if q[0] == task]
        found["by_task"][task] = {"n": len(ws), "accuracy": 1 - sum(ws) / len(ws) if ws else None}
    write_atomic(a.out, json.dumps(found, indent=2, ensure_ascii=False))
    f = lambda x: "–" if x is None else f"{x:.3f}"  # noqa: E731
    print(f"{len(qs)} questions, accuracy {found['accuracy']:.3f}: " +
          ", ".join(f"{k} {f(v['accuracy'])} ({v['n']})" for k, v in found["by_task"].items()))  # fmt: skip
    print("| score | AUROC (wrong) | 95% CI | PRR | 95% CI |\n|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['score']} | {f(r['auroc'])} | {f(r['auroc_95'][0])}–{f(r['auroc_95'][1])} | {f(r['prr'])} | "
              f"{f(r['prr_95'][0])}–{f(r['prr_95'][1])} |")  # fmt: skip


if __name__ == "__main__":
    main()
