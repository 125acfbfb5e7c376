"""Regenerate what the docs derive from code and results, so that it cannot drift:

- docs/CLI.md: every command and flag, from the argparse definitions (qat_lora.commands.cli.build_parser);
- README.md's headline table (between its `headline` markers) and docs/results/headline.png: rows of
  docs/results/recovery.json, chosen by key below, each with its bits per weight as shipped.

    python docs/generate.py            # rewrite them
    python docs/generate.py --check    # exit 1 naming what is stale (tests/test_docs.py runs this)
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CLI_MD = ROOT / "docs" / "CLI.md"
README = ROOT / "README.md"
RECOVERY_JSON = ROOT / "docs" / "results" / "recovery.json"
HEADLINE_PNG = ROOT / "docs" / "results" / "headline.png"
HEADLINE_START, HEADLINE_END = "<!-- headline:start -->", "<!-- headline:end -->"
sys.path.insert(0, str(ROOT))  # this checkout's qat_lora, installed or not

# (label, recovery.json key, the adapter ships unmerged beside the base). All SmolLM2-135M-Instruct, Wikipedia
# leads at context 512; the trained rows ran cpu-medium (297 k tokens of teacher-written text).
HEADLINE = [
    ("teacher, SmolLM2-135M-Instruct", "cpu-medium/teacher/0f10509c44", False),
    ("3-bit, round-to-nearest", "cpu-small/w3g64/ptq-rtn/418ff6cc56", False),
    ("3-bit, GPTQ (no training)", "cpu-medium/w3g64/ptq-gptq/e834174937", False),
    ("3-bit, GPTQ + KD of the weights on the grid", "cpu-medium/w3g64/weight-qat/eca742ed02", False),
    ("3-bit, GPTQ + recovery LoRA r16 (unmerged)", "cpu-medium/w3g64/lora-topk-tail/r16/eaef01261b", True),
]
# Drawn beside the table's rows in the picture, for scale: the next bit width with no training.
FOR_SCALE = [("4-bit, GPTQ (no training)", "cpu-medium/w4g64/ptq-gptq/6cba5a48c4", False)]


def cli_markdown() -> str:
    """docs/CLI.md: each command's one-line help, then a table of its flags with their defaults."""
    from qat_lora.commands.cli import build_parser

    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    helps = {a.dest: a.help for a in sub._choices_actions}
    out = ["# Command line reference", "",
           "Generated from the parser by `python docs/generate.py` (a test fails when it is stale): every command of",
           "`qat-lora` and every flag, with its default. What each command is for, task by task: [GUIDE.md](GUIDE.md).",
           "", "| command | what it does |", "|---|---|"]
    out += [f"| [`{name}`](#{name}) | {helps.get(name, '')} |" for name in sub.choices]
    for name, command in sub.choices.items():
        positionals = " ".join(a.dest.upper() for a in command._actions if not a.option_strings)
        out += ["", f"## {name}", "", helps.get(name, "") + ".", "", "```",
                f"qat-lora {name} {positionals} [flags]".replace("  ", " "), "```"]
        rows = [_flag_row(a) for a in command._actions if not isinstance(a, argparse._HelpAction)
                and "--version" not in a.option_strings]
        if rows:
            out += ["", "| flag | default | what it does |", "|---|---|---|", *rows]
    return "\n".join(out) + "\n"


def _flag_row(action: argparse.Action) -> str:
    name = ", ".join(action.option_strings) or action.dest
    if action.choices:
        name += " {" + ",".join(str(c) for c in action.choices) + "}"
    elif action.nargs != 0 and action.option_strings:
        name += " " + (action.metavar or action.dest.upper())
    default = action.default
    if default is None or default is False or default in ("", []) or default is argparse.SUPPRESS \
            or action.nargs == 0:
        shown = ""
    else:
        shown = " ".join(map(str, default)) if isinstance(default, list) else str(default)
    text = (action.help or "").replace("|", "\\|").replace("\n", " ")
    return f"| `{name.replace('|', chr(92) + '|')}` | {f'`{shown}`' if shown else ''} | {text} |"


def headline_rows() -> list[dict]:
    """The headline rows with their bits per weight shipped: the base's (a record without it takes the bits a
    record of the same preset measured) plus, for an unmerged adapter, the adapter's."""
    from qat_lora.quant.state import FULL_PRECISION_BITS

    records = {r["key"]: r for r in json.loads(RECOVERY_JSON.read_text())["records"]}
    preset_bits = {r["preset"]: r["bits_per_weight"] for r in records.values() if r.get("bits_per_weight")}
    rows = []
    for label, key, with_adapter in HEADLINE + FOR_SCALE:
        rec = records[key]  # a missing key is a stale table: KeyError names it
        if rec["preset"] is None:
            bits = FULL_PRECISION_BITS
        else:
            bits = rec.get("bits_per_weight") or preset_bits[rec["preset"]]
        if with_adapter:
            bits += rec["adapter_bits_per_weight"]
        rows.append({"label": label, "key": key, "bits": round(bits, 2), "ppl": rec["ppl"],
                     "tokens": rec["tokens"], "context": rec["eval_seq_len"], "scale": (label, key, with_adapter)
                     in FOR_SCALE})
    return rows


def headline_table(rows: list[dict]) -> str:
    out = ["| model | bits per weight shipped | Wikipedia perplexity (context 512) | training tokens |",
           "|---|---|---|---|"]
    for row in rows:
        if row["scale"]:
            continue
        assert row["context"] == 512, f"{row['key']}: context {row['context']}, the table says 512"
        tokens = f"{row['tokens'] / 1000:.0f} k" if row["tokens"] else "–"
        out.append(f"| {row['label']} | {row['bits']:g} | {row['ppl']:.2f} | {tokens} |")
    return "\n".join(out)


def _colour(row: dict) -> str:
    if row["scale"] or row["key"].split("/")[1] == "teacher":
        return "#aaaaaa"
    return "#3b75af" if row["tokens"] else "#e1812c"  # trained, or one-shot


def draw_headline(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 3.2), dpi=100)
    labels = [f"{r['label']}  ({r['bits']:g} bits)" for r in rows][::-1]
    values = [r["ppl"] for r in rows][::-1]
    colours = [_colour(r) for r in rows][::-1]
    bars = ax.barh(labels, values, color=colours)
    for bar, value in zip(bars, values):
        ax.text(bar.get_width() + 0.4, bar.get_y() + bar.get_height() / 2, f"{value:.2f}", va="center", fontsize=9)
    ax.set_xlabel("held-out Wikipedia perplexity (lower is better)")
    ax.set_xlim(0, max(values) * 1.12)
    fig.suptitle("SmolLM2-135M-Instruct: one-shot 3-bit (orange) and recovered 3-bit (blue), bits per weight shipped",
                 fontsize=10, x=0.01, ha="left")
    ax.spines[["top", "right"]].set_visible(False)
    fig.tight_layout()
    fig.savefig(path, metadata={"Software": None})  # no version stamp: regenerating changes nothing
    plt.close(fig)


def _with_headline(readme: str, table: str) -> str:
    start, end = readme.index(HEADLINE_START), readme.index(HEADLINE_END)
    return readme[:start + len(HEADLINE_START)] + "\n" + table + "\n" + readme[end:]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--check", action="store_true", help="change nothing; exit 1 naming what is stale")
    args = parser.parse_args(argv)
    rows = headline_rows()
    expected = {CLI_MD: cli_markdown(), README: _with_headline(README.read_text(), headline_table(rows))}
    stale = [path for path, text in expected.items() if not path.exists() or path.read_text() != text]
    if args.check:
        if not HEADLINE_PNG.exists():
            stale.append(HEADLINE_PNG)
        for path in stale:
            print(f"{path.relative_to(ROOT)} is stale: run python docs/generate.py", file=sys.stderr)
        return 1 if stale else 0
    for path in stale:
        path.write_text(expected[path])
        print(f"wrote {path.relative_to(ROOT)}")
    draw_headline(rows, HEADLINE_PNG)
    print(f"wrote {HEADLINE_PNG.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
