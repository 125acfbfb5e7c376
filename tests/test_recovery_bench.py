"""benchmarks/recovery.py end to end on a tiny model: every method, one preset, a few steps, run twice."""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from conftest import load_benchmark, synthetic_text
from qat_lora.data import text as data

ROOT = Path(__file__).resolve().parents[1]
REQUIRED = ("key", "budget", "preset", "method", "ppl", "nll", "gap_recovered", "gap_recovered_nats", "nll_gap_nats",
            "ppl_ratio", "start_init", "tokens", "wall_s", "device", "kd_kl", "kd_top1", "lora_r",
            "cache_bytes_per_token", "run_dir")
# Every method but lora-topk-renorm (the same trainer with one more TrainConfig flag), to stay under a minute.
METHODS = ("teacher", "ptq-rtn", "ptq-init", "ptq-hqq", "ptq-act", "ptq-gptq", "ptq-blockwise",
           "lora-topk-tail", "lora-sampled", "lora-topk-wide", "lora-online", "lora-topk-tail-ce", "ce-only", "qat",
           "qat-online", "qat+lora", "weight-qat", "weight-qat+lora", "lora-qat", "weight-qat-online")


def _load_script():
    return load_benchmark("recovery", "recovery_bench")


@pytest.fixture(scope="module")
def recovery():
    return _load_script()


@pytest.fixture(scope="module")
def tiny_args(tmp_path_factory, teacher_dir, corpus_dir) -> list[str]:
    root = tmp_path_factory.mktemp("recovery")
    eval_text = root / "eval.txt"
    eval_text.write_text(synthetic_text(40, seed=3))  # not in the training corpus
    news_text = root / "news.txt"
    news_text.write_text(synthetic_text(40, seed=4))  # the second held-out domain
    return ["--teacher", str(teacher_dir), "--train-text", str(corpus_dir), "--eval-text", str(eval_text),
            "--news-text", str(news_text),
            "--work", str(root / "work"), "--json", str(root / "results" / "recovery.json"),
            "--presets", "w4g32", "--methods", *METHODS, "--ranks", "4", "--main-rank", "4",
            "--max-steps", "2", "--batch-size", "4", "--seq-len", "32", "--top-k", "8", "--cache-tokens", "3000",
            "--eval-tokens", "600", "--eval-seq-len", "64", "--lr", "3e-3", "--qat-lr", "3e-3", "--weight-lr", "1e-3",
            "--calib-sequences", "8", "--blockwise-steps", "4", "--device", "cpu",
            "--budget-name", "test"]


@pytest.fixture(scope="module")
def first_run(recovery, tiny_args):
    # One thread: a 64-wide model gains nothing from two, and on a busy 2-core host their spin-waits cost ~2x.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield recovery.main(tiny_args)
    finally:
        torch.set_num_threads(threads)


def _by_method(records: list[dict]) -> dict[str, dict]:
    return {r["method"]: r for r in records}


@pytest.mark.slow
def test_one_record_per_row_with_every_field(first_run, tiny_args):
    path = Path(tiny_args[tiny_args.index("--json") + 1])
    saved = json.loads(path.read_text())
    assert saved == first_run and "host" in saved
    records = saved["records"]
    assert [r["method"] for r in records] == list(METHODS)
    assert len({r["key"] for r in records}) == len(records)
    for r in records:
        assert all(k in r for k in REQUIRED), sorted(set(REQUIRED) - set(r))
        assert math.isfinite(r["ppl"]) and r["ppl"] > 1 and math.isfinite(r["nll"]) and r["device"].startswith("cpu")
        assert r["budget"] == "test" and r["preset"] == (None if r["method"] == "teacher" else "w4g32")
    by = _by_method(records)
    assert by["qat"]["lora_r"] is None and by["lora-sampled"]["lora_r"] == 4
    assert by["lora-sampled"]["cache_encoding"]["name"] == "sampled" and by["ce-only"]["cache_encoding"]["name"] == "topk"
    # the KD weight each LoRA row trained with, as its run folder records it (1 = pure KD, 0 = plain CE)
    alphas = {m: json.loads((Path(by[m]["run_dir"]) / "config.json").read_text())["alpha"]
              for m in ("lora-topk-tail", "lora-topk-tail-ce", "ce-only")}
    assert alphas == {"lora-topk-tail": 1.0, "lora-topk-tail-ce": 0.5, "ce-only": 0.0}
    assert len({by[m]["ppl"] for m in alphas}) == 3  # three different objectives, three different students
    # what an unmerged adapter adds to the low-bit base: rank 4 on the tiny model's linears; qat has none
    assert by["qat"]["adapter_bits_per_weight"] == 0 < by["lora-topk-tail"]["adapter_bits_per_weight"]
    assert by["lora-topk-tail"]["bits_per_weight"] == by["ptq-rtn"]["bits_per_weight"]


def test_gaps_follow_from_the_perplexities(first_run):
    by = _by_method(first_run["records"])
    # w4g32 starts from round-to-nearest, its preset's init (the MSE init measured worse at 4 bits: w4g64, w4pc)
    teacher, start = by["teacher"], by["ptq-rtn"]
    assert teacher["gap_recovered"] == 1.0 and teacher["nll_gap_nats"] == 0.0
    for r in first_run["records"][1:]:
        assert r["start_init"] == "rtn" and r["ptq_ppl"] == start["ppl"] and r["teacher_ppl"] == teacher["ppl"]
        assert r["gap_recovered"] == pytest.approx((start["ppl"] - r["ppl"]) / (start["ppl"] - teacher["ppl"]))
        assert r["gap_recovered_nats"] == pytest.approx((start["nll"] - r["nll"]) / (start["nll"] - teacher["nll"]))
        # The second domain: its own perplexity and gaps, from its own teacher and start rows.
        assert r["news_text"] == "news.txt" and r["ppl_news"] != r["ppl"] and r["news_tokens"] > 0
        assert r["ppl_ratio_news"] == pytest.approx(r["ppl_news"] / teacher["ppl_news"])
        assert r["gap_recovered_news"] == pytest.approx(
            (start["ppl_news"] - r["ppl_news"]) / (start["ppl_news"] - teacher["ppl_news"]))
        assert r["nll_gap_nats"] == pytest.approx(r["nll"] - teacher["nll"])
        assert r["ppl_ratio"] == pytest.approx(r["ppl"] / teacher["ppl"])
    assert start["gap_recovered"] == 0.0 and by["ptq-init"]["init"] == "mse"


def test_tokens_and_stages(first_run):
    by = _by_method(first_run["records"])
    assert all(by[m]["tokens"] == 0 and by[m]["run_dir"] is None
               for m in ("teacher", "ptq-rtn", "ptq-init", "ptq-hqq", "ptq-act", "ptq-gptq", "ptq-blockwise"))
    blockwise = json.loads((Path(by["ptq-blockwise"]["quantizer"]).parent / "quantize.json").read_text())
    assert blockwise["config"]["blockwise_steps"] == 4 and blockwise["config"]["init"] == "gptq"
    assert by["ptq-blockwise"]["quantizer"] != by["ptq-gptq"]["quantizer"]
    # a data-aware row records its calibration size, which its table row shows (rows differ by nothing else)
    assert {by[m]["calib_sequences"] for m in ("ptq-act", "ptq-gptq", "ptq-blockwise")} == {8}
    assert "calib_sequences" not in by["ptq-rtn"]
    lora = by["lora-topk-tail"]
    assert lora["tokens"] == 2 * 4 * 32 and lora["steps"] == 2
    stages = by["qat+lora"]["stages"]
    assert [s["train_preset"] for s in stages] == ["qat", "recovery-lora"]
    assert stages[0]["run_dir"] == by["qat"]["run_dir"]  # the qat row's run is the first stage, trained once
    assert by["qat+lora"]["tokens"] == by["qat"]["tokens"] + lora["tokens"]
    assert by["qat+lora"]["wall_s"] == pytest.approx(sum(s["wall_s"] for s in stages), abs=0.02)
    stages = by["weight-qat+lora"]["stages"]
    assert [s["train_preset"] for s in stages] == ["weight-qat", "recovery-lora"]
    assert stages[0]["run_dir"] == by["weight-qat"]["run_dir"] and by["weight-qat"]["lora_r"] is None
    lora_stage = json.loads((Path(stages[1]["run_dir"]) / "config.json").read_text())
    assert lora_stage["quantizer"] == str(Path(stages[0]["run_dir"]) / "quantizer.safetensors")
    sampled, topk = by["lora-sampled"]["cache_bytes_per_token"], by["lora-topk-tail"]["cache_bytes_per_token"]
    assert sampled > 0 and topk > 0
    # The same tokens, other targets: a wider top-K cache, and the teacher run in the step (tokens only).
    wide, online = by["lora-topk-wide"], by["lora-online"]
    assert wide["cache_encoding"]["top_k"] == 128 and wide["cache_bytes_per_token"] > topk
    assert online["cache_encoding"] == {"name": "online"} and online["cache_bytes_per_token"] == 5
    assert json.loads((Path(online["run_dir"]) / "config.json").read_text())["online_teacher"] == \
        json.loads((Path(lora["run_dir"]) / "config.json").read_text())["model"]
    # qat-online: the grid trained on the teacher run in the step, no adapter, the qat row's start and rate
    qat_online, qat_config = by["qat-online"], json.loads((Path(by["qat"]["run_dir"]) / "config.json").read_text())
    config = json.loads((Path(qat_online["run_dir"]) / "config.json").read_text())
    assert qat_online["cache_encoding"] == {"name": "online"} and qat_online["lora_r"] is None
    assert config["preset"] == "qat" and config["online_teacher"] == qat_config["model"]
    assert (config["lr"], config["quantizer"]) == (qat_config["lr"], qat_config["quantizer"])
    assert qat_online["adapter_bits_per_weight"] == 0 and qat_online["ppl"] != by["qat"]["ppl"]
    # weight-qat-online: the latent weights too, at weight-qat's rates
    config = json.loads((Path(by["weight-qat-online"]["run_dir"]) / "config.json").read_text())
    weight_qat = json.loads((Path(by["weight-qat"]["run_dir"]) / "config.json").read_text())
    assert config["preset"] == "weight-qat" and config["online_teacher"] == qat_config["model"]
    assert (config["lr"], config["weight_lr_ratio"]) == (weight_qat["lr"], weight_qat["weight_lr_ratio"])
    # lora-qat: one stage training the adapter and the scales/zeros together, the scales at --lr x the ratio;
    # the student evaluated is that run's adapter over that run's quantiser
    joint = by["lora-qat"]
    assert [s["train_preset"] for s in joint["stages"]] == ["qat+lora"] and joint["lora_r"] == 4
    config = json.loads((Path(joint["run_dir"]) / "config.json").read_text())
    assert config["preset"] == "qat+lora" and config["quantizer_lr_ratio"] == 0.1 and config["lr"] == 3e-3
    assert joint["stages"][0]["quantizer"] == str(Path(joint["run_dir"]) / "quantizer.safetensors")
    assert joint["stages"][0]["adapter"] == str(Path(joint["run_dir"]) / "adapter")
    assert joint["ppl"] not in (lora["ppl"], by["qat"]["ppl"])


def _teacher_and_lora_into_own_results(tiny_args, tmp_path) -> tuple[list[str], Path]:
    """tiny_args running only the teacher and lora-topk-tail rows, into a copy of the first run's results."""
    args = list(tiny_args)
    results = tmp_path / "recovery.json"
    results.write_text(Path(args[args.index("--json") + 1]).read_text())
    args[args.index("--json") + 1] = str(results)
    methods = args.index("--methods")
    args[methods + 1:methods + 1 + len(METHODS)] = ["teacher", "lora-topk-tail"]
    return args, results


def test_start_from_a_data_aware_init(recovery, first_run, tiny_args, tmp_path):
    # --start gptq: the GPTQ row (already computed by the first run: its record and init file are reused) is
    # every trained row's start; gaps are measured against it. Its own results file: the others stay as they are.
    args, _ = _teacher_and_lora_into_own_results(tiny_args, tmp_path)
    args += ["--start", "gptq"]
    by = _by_method(recovery.main(args)["records"])
    first = _by_method(first_run["records"])
    gptq, lora = by["ptq-gptq"], [r for r in recovery.load_results(Path(args[args.index("--json") + 1]))["records"]
                                  if r["method"] == "lora-topk-tail" and r["start_init"] == "gptq"][0]
    assert gptq["ppl"] == first["ptq-gptq"]["ppl"] and lora["ptq_ppl"] == gptq["ppl"] and lora["init"] == "gptq"
    run_config = json.loads((Path(lora["run_dir"]) / "config.json").read_text())
    assert run_config["quantizer"] == gptq["quantizer"] and lora["key"] != first["lora-topk-tail"]["key"]


def test_calibrated_lora_start_is_its_own_row(recovery, first_run, tiny_args, tmp_path):
    # --lora-init calibrated: a new key and run (the zero-start rows keep theirs), recorded per stage and marked in
    # the table's lr column.
    args, results = _teacher_and_lora_into_own_results(tiny_args, tmp_path)
    args.insert(args.index("lora-topk-tail") + 1, "lora-qat")  # the joint adapter + scales stage starts calibrated too
    out = recovery.main(args + ["--lora-init", "calibrated"])
    zero = _by_method(first_run["records"])
    for method in ("lora-topk-tail", "lora-qat"):
        calibrated = [r for r in out["records"] if r["method"] == method
                      and r["stages"][0].get("lora_init") == "calibrated"]
        assert len(calibrated) == 1 and calibrated[0]["key"] != zero[method]["key"]
        assert "lora_init" not in zero[method]["stages"][0]
        assert json.loads((Path(calibrated[0]["run_dir"]) / "config.json").read_text())["lora_init"] == "calibrated"
    assert " cal. |" in results.with_suffix(".md").read_text()


def test_bf16_training_is_its_own_row(recovery, first_run, tiny_args, tmp_path):
    # --precision bf16 (what `auto` means on CUDA) trains under bf16 autocast: a new key and run, the precision in
    # the run's config and the record; rows trained in fp32 keep their keys and say fp32.
    args, _ = _teacher_and_lora_into_own_results(tiny_args, tmp_path)
    bf16 = _by_method(recovery.main(args + ["--precision", "bf16"])["records"])["lora-topk-tail"]
    fp32 = _by_method(first_run["records"])["lora-topk-tail"]
    assert bf16["key"] != fp32["key"] and bf16["stages"][0]["precision"] == "bf16"
    assert fp32["stages"][0]["precision"] == "fp32"
    assert json.loads((Path(bf16["run_dir"]) / "config.json").read_text())["precision"] == "bf16"
    assert json.loads((Path(fp32["run_dir"]) / "config.json").read_text())["precision"] == "fp32"


def test_act_order_gptq_is_its_own_init(recovery, first_run, tiny_args, tmp_path):
    args, _ = _teacher_and_lora_into_own_results(tiny_args, tmp_path)
    by = _by_method(recovery.main(args + ["--start", "gptq", "--act-order"])["records"])
    gptq, plain = by["ptq-gptq"], _by_method(first_run["records"])["ptq-gptq"]
    assert gptq["init"] == "gptq act-order" and gptq["key"] != plain["key"] and gptq["quantizer"] != plain["quantizer"]
    assert json.loads((Path(gptq["quantizer"]).parent / "quantize.json").read_text())["config"]["act_order"] is True
    assert by["lora-topk-tail"]["start_init"] == "gptq act-order"


def test_second_run_skips_every_row(recovery, first_run, tiny_args):
    work = Path(tiny_args[tiny_args.index("--work") + 1])
    before = {p: p.stat().st_mtime_ns for p in work.rglob("*")}
    again = recovery.main(tiny_args)
    assert again == first_run  # same records: wall_s included, nothing retrained or re-evaluated
    assert {p: p.stat().st_mtime_ns for p in work.rglob("*")} == before


def test_markdown_table_and_plots(first_run, tiny_args):
    json_path = Path(tiny_args[tiny_args.index("--json") + 1])
    table = json_path.with_suffix(".md").read_text()
    rows = [line for line in table.splitlines() if line.startswith("| test |")]
    assert len(rows) == len(first_run["records"])
    assert all(f"| {m} |" in table for m in METHODS)
    for record, row in zip(first_run["records"], rows):  # each row names its stages' learning rates
        rates = [f"{s['lr']:g}" + (f" (w {s['weight_lr']:g})" if "weight_lr" in s else "")
                 for s in record.get("stages") or []]
        assert all("weight_lr" in s for s in record.get("stages") or [] if s["train_preset"] == "weight-qat")
        assert f"| {' / '.join(rates) or '–'} |" in row and (record["method"] != "qat+lora" or len(rates) == 2)
        assert ("| gptq (8 seq.) |" in row) == (record["method"] == "ptq-gptq")
    pytest.importorskip("matplotlib")
    assert (json_path.parent / "recovery_test_gap.png").stat().st_size > 0  # per budget: "test"
    assert (json_path.parent / "recovery_test_loss_w4g32.png").stat().st_size > 0
    assert (json_path.parent / "recovery_ppl_tokens.png").stat().st_size > 0
    assert (json_path.parent / "recovery_frontier.png").stat().st_size > 0


def test_a_loss_plot_is_kept_when_a_run_folder_is_gone(recovery, first_run, tiny_args, tmp_path):
    """Records from another machine's --work have no metrics here: redrawing would drop their curves."""
    pytest.importorskip("matplotlib")
    records = [{**r, "stages": [{**s, "run_dir": str(tmp_path / "gone")} for s in r["stages"]]}
               if r["method"] == "qat" else r for r in first_run["records"]]
    json_path = tmp_path / "recovery.json"
    plot = tmp_path / "recovery_test_loss_w4g32.png"
    plot.write_bytes(b"drawn before")
    paths = recovery.write_plots(json_path, "test", records, records)
    assert plot.read_bytes() == b"drawn before" and plot not in paths
    plot.unlink()  # no plot yet: drawn with the curves there are
    assert plot in recovery.write_plots(json_path, "test", records, records) and plot.stat().st_size > 0


def test_bits_shipped_count_an_unmerged_adapter_and_the_frontier_keeps_the_undominated(recovery):
    records = [{"preset": None, "method": "teacher", "lora_r": None, "tokens": 0, "ppl": 13.5},
               {"preset": "w3g64", "method": "ptq-gptq", "lora_r": None, "tokens": 0, "ppl": 24.0,
                "bits_per_weight": 3.5},
               {"preset": "w3g64", "method": "weight-qat", "lora_r": None, "tokens": 9, "ppl": 20.4},
               {"preset": "w3g64", "method": "lora-topk-tail", "lora_r": 64, "tokens": 9, "ppl": 16.7,
                "bits_per_weight": 3.5, "adapter_bits_per_weight": 2.9444},
               {"preset": "w3g64", "method": "lora-topk-tail", "lora_r": 16, "tokens": 9, "ppl": 18.8},
               {"preset": "w3g64", "method": "qat", "lora_r": None, "tokens": 9, "ppl": 30.0}]
    bits = [recovery.shipped_bits(r, records) for r in records]
    # Older records take their preset's measured bits, and adapter bits scaled by rank from a record that has them.
    assert bits == pytest.approx([16.0, 3.5, 3.5, 6.4444, 3.5 + 2.9444 / 4, 3.5])
    assert recovery.frontier([(3.5, 24.0), (3.5, 20.4), (4.24, 18.8), (6.44, 16.7), (6.0, 19.0), (4.5, 15.6)]) \
        == [(3.5, 20.4), (4.24, 18.8), (4.5, 15.6)]
    filler = {"budget": "b", "nll": 1.0, "nll_gap_nats": 0.0, "ppl_ratio": 1.0, "gap_recovered": 0.0,
              "gap_recovered_nats": 0.0, "kd_kl": 0.0, "kd_top1": 1.0, "wall_s": 0.0, "device": "cpu", "init": None}
    records[-1] |= {"train_text": ["prefix-320k-p90"], "train_text_sha256": "98b898c7e462"}
    table = recovery.markdown_table([{**r, **filler} for r in records])
    assert "| bits shipped |" in table
    # Rows of two texts are told apart: the text's folder and its digest (a regenerated text keeps its name).
    assert table.splitlines()[-1].startswith("| b | prefix-320k-p90 (98b898c7) | w3g64 | qat |")
    assert table.splitlines()[2].startswith("| b | – |")


def test_ppl_series_joins_budgets_of_one_method(recovery):
    def record(method, tokens, ppl, text=None, start="gptq", r=16, lr=0.002):
        return {"preset": "w3g64", "method": method, "lora_r": r, "tokens": tokens, "ppl": ppl,
                "start_init": start, "train_text": text, "stages": [{"lr": lr}] if tokens else []}
    records = [record("ptq-gptq", 0, 24.0, r=None),
               record("lora-topk-tail", 40960, 20.2, ["prefix"]),
               record("lora-topk-tail", 296960, 19.0, ["prefix-320k"]),
               record("lora-topk-tail", 296960, 18.7, ["prefix-320k"]),  # a later rerun of the same point
               record("lora-topk-tail", 40960, 21.9),
               record("ce-only", 40960, 20.8, ["prefix"]),
               record("lora-topk-tail", 296960, 18.9, ["prefix-320k"], lr=0.001),  # another lr: its own series
               {**record("lora-topk-tail", 40960, 70.0, ["prefix"]), "preset": "w2g64"}]
    assert recovery.ppl_series(records, "w3g64") == {
        "lora-topk-tail r16 lr 0.002 from gptq (prefix)": [(40960, 20.2), (296960, 18.7)],
        "lora-topk-tail r16 lr 0.002 from gptq (default text)": [(40960, 21.9)],
        "ce-only r16 lr 0.002 from gptq (prefix)": [(40960, 20.8)],
        "lora-topk-tail r16 lr 0.001 from gptq (prefix)": [(296960, 18.9)]}
    assert recovery.text_family(["prefix-320k", "general"]) == "prefix, general"
    assert recovery.text_family(["run-2k-notes"]) == "run-2k-notes"
    assert recovery.text_family(["prefix-1m"]) == "prefix"


def test_extrapolation_follows_a_power_law_in_the_gap_to_the_teacher(recovery, tmp_path):
    teacher = 13.5
    law = [(t, teacher + 40.0 * (t / 40960) ** -0.3) for t in (40960, 296960, 1_000_448)]
    assert recovery.extrapolate_ppl(law, teacher, 5_000_000) == pytest.approx(
        teacher + 40.0 * (5_000_000 / 40960) ** -0.3, rel=1e-9)  # an exact power law is continued exactly
    noisy = [(40960, 20.15), (296960, 16.68), (1_000_448, 15.9)]
    ahead = recovery.extrapolate_ppl(noisy, teacher, 5_000_000)
    assert teacher < ahead < 15.9  # still falling, never below the teacher
    assert recovery.extrapolate_ppl(noisy[:2], teacher) is None  # two points fit any line
    assert recovery.extrapolate_ppl([(1, 20.0), (2, 20.0), (4, 21.0)], teacher) is None  # not falling
    assert recovery.extrapolate_ppl([(1, 20.0), (2, 13.0), (4, 12.0)], teacher) is None  # below the teacher
    matplotlib = pytest.importorskip("matplotlib")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = [{"preset": "", "method": "teacher", "tokens": 0, "ppl": teacher}] + [
        {"preset": "w3g64", "method": "lora-topk-tail", "lora_r": 64, "tokens": t, "ppl": p, "start_init": "gptq",
         "train_text": ["prefix-1m"], "stages": [{"lr": 5e-4}]} for t, p in noisy]
    path = recovery.plot_ppl_tokens(plt, records, tmp_path / "ppl_tokens.png")
    assert path.stat().st_size > 0


@pytest.mark.parametrize("flag, value, message", [
    ("--methods", "bogus", "invalid choice: 'bogus'"),
    ("--presets", "w5g7", "invalid choice: 'w5g7'"),
    ("--teacher", "/nonexistent/teacher", "--teacher /nonexistent/teacher: no such folder"),
    ("--eval-text", "/nonexistent/wiki.txt", "--eval-text /nonexistent/wiki.txt: not found"),
    ("--news-text", "/nonexistent/news.txt", "--news-text /nonexistent/news.txt: not found"),
    ("--eval-seq-len", "4096", "--eval-seq-len 4096: longer than the teacher's context (128 positions)"),
    ("--budget-name", "gpu/5m", "--budget-name 'gpu/5m': use letters, digits"),  # it names plot files
])
def test_bad_input_is_a_one_line_error(recovery, tiny_args, capsys, flag, value, message):
    args = list(tiny_args)
    args[args.index(flag) + 1] = value
    with pytest.raises(SystemExit) as exit_info:
        recovery.main(args)
    assert exit_info.value.code != 0
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("flag", ["--eval-text", "--news-text"])
def test_eval_text_inside_the_training_text_is_refused(recovery, tiny_args, corpus_dir, capsys, flag):
    args = list(tiny_args)
    args[args.index(flag) + 1] = str(corpus_dir / "b.txt")
    with pytest.raises(SystemExit):
        recovery.main(args)
    assert "must stay held out" in capsys.readouterr().err


@pytest.mark.slow
def test_searched_init_is_computed_once_by_the_start_row(recovery, first_run, tiny_args, teacher_dir, monkeypatch):
    # w2g32 starts from the MSE search: its PTQ row saves the quantiser, and the training run loads that file
    # instead of searching again (build_student is never asked for a fresh w2g32 init).
    import qat_lora.train.run as run_module  # where the trainer's set-up looks build_student up
    from safetensors.torch import load_file

    from qat_lora.train.config import StudentSpec
    from qat_lora.quant.state import quantizer_state_dict

    searched = []
    real_build = run_module.build_student

    def counting_build(spec, *rest, **kw):
        if not spec.quantizer:
            searched.append(spec.quant)
        return real_build(spec, *rest, **kw)

    monkeypatch.setattr(run_module, "build_student", counting_build)
    args = list(tiny_args)
    args[args.index("--presets") + 1] = "w2g32"
    methods = args.index("--methods")
    args[methods + 1:methods + 1 + len(METHODS)] = ["ptq-init", "lora-topk-tail"]
    args[args.index("--max-steps") + 1] = "1"
    records = [r for r in recovery.main(args)["records"] if r["preset"] == "w2g32"]
    assert [r["method"] for r in records] == ["ptq-init", "lora-topk-tail"]
    assert records[1]["start_init"] == "mse" and records[1]["ptq_ppl"] == records[0]["ppl"]
    assert searched == []
    work = Path(args[args.index("--work") + 1])
    (init_file,) = (work / "init").glob("w2g32-*.safetensors")
    run_config = json.loads((Path(records[1]["run_dir"]) / "config.json").read_text())
    assert run_config["quantizer"] == str(init_file)
    saved = load_file(str(init_file))
    fresh = quantizer_state_dict(real_build(StudentSpec(str(teacher_dir), "w2g32")))
    assert saved.keys() == fresh.keys() and all(torch.equal(saved[k], fresh[k]) for k in fresh)


def test_rows_written_by_another_process_meanwhile_are_kept(recovery, first_run, tiny_args, tmp_path, monkeypatch):
    # Two benchmark commands sharing one --json: each adds its rows to the file as it is now, never writes back
    # the copy it read at its start (that lost the block-wise rows once).
    args = list(tiny_args)
    json_path = tmp_path / "shared.json"
    args[args.index("--json") + 1] = str(json_path)
    methods = args.index("--methods")
    args[methods + 1:methods + 1 + len(METHODS)] = ["teacher", "ptq-rtn"]
    real_run_row = recovery.run_row

    def meanwhile(*a, **kw):
        other = {**first_run["records"][0], "budget": "other"}  # a row of another command
        recovery.add_record(json_path, {**other, "key": f"other/{len(recovery.load_results(json_path)['records'])}"})
        return real_run_row(*a, **kw)

    monkeypatch.setattr(recovery, "run_row", meanwhile)
    recovery.main(args)
    keys = [r["key"] for r in recovery.load_results(json_path)["records"]]
    assert keys[0] == "other/0" and keys[2] == "other/2" and len(keys) == 4
    assert {recovery.load_results(json_path)["records"][i]["method"] for i in (1, 3)} == {"teacher", "ptq-rtn"}


def test_a_training_text_changed_in_place_is_refused_not_reused(recovery, tiny_args, corpus_dir, tmp_path):
    """Caches and rows are named by the text's path: new content at that path must not train on the old cache or
    pass for the old rows (it once did: a regenerated teacher text reused the lost text's GPTQ row)."""
    import shutil

    text = tmp_path / "text"
    shutil.copytree(corpus_dir, text)
    args = list(tiny_args)
    for flag, value in (("--train-text", str(text)), ("--work", str(tmp_path / "work")),
                        ("--json", str(tmp_path / "results.json"))):
        args[args.index(flag) + 1] = value
    methods = args.index("--methods")
    args[methods + 1:methods + 1 + len(METHODS)] = ["teacher"]
    first = recovery.main(args)["records"][0]
    assert first["train_text_sha256"] == data.corpus_fingerprint(data.list_text_files([str(text)]))
    assert recovery.main(args)["records"] == [first]  # the same text: the row is reused
    victim = sorted(text.iterdir())[0]
    victim.write_text(victim.read_text() + "\nOne more line, written after the cache was built.\n")
    with pytest.raises(ValueError, match=r"--train-text .*: changed since .*caches/topk-.* was built from it"):
        recovery.main(args)
    cache, = (tmp_path / "work" / "caches").iterdir()
    shutil.rmtree(cache)  # the cache rebuilt from the new text: the recorded row is still the old text's
    with pytest.raises(SystemExit):
        recovery.main(args)
    assert json.loads((tmp_path / "results.json").read_text())["records"] == [first]  # nothing overwritten


def test_recount_zero_bits_rewrites_each_fp16_zero_record_once(teacher_dir, tmp_path):
    """benchmarks/recount_zero_bits.py: a record counted with fp16 integer zeros gets the codes' width (the old
    figure kept); one counted so already, a float offset, and a second pass are left alone."""
    from qat_lora.data import models

    recount = load_benchmark("recount_zero_bits")
    records = [{"key": "old", "preset": "w4g64", "bits_per_weight": 4.5},
               {"key": "new", "preset": "w4g64", "bits_per_weight": 4.3125},
               {"key": "offset", "preset": "w4g64f", "bits_per_weight": 4.5},
               {"key": "old-g32", "preset": "w2g32", "bits_per_weight": 3.0},
               {"key": "other", "preset": "w3g64", "bits_per_weight": 3.9}]
    path = tmp_path / "results.json"
    path.write_text(json.dumps({"host": {}, "records": records}))
    shapes = models.linear_shapes(teacher_dir)
    assert recount.recount(path, shapes) == 2
    got = {r["key"]: r for r in json.loads(path.read_text())["records"]}
    assert got["old"] == {**records[0], "bits_per_weight": 4 + (16 + 4) / 64, "bits_per_weight_fp16_zeros": 4.5}
    assert got["old-g32"]["bits_per_weight"] == 2 + (16 + 2) / 32
    assert [got[k] for k in ("new", "offset", "other")] == [records[1], records[2], records[4]]
    assert recount.recount(path, shapes) == 0
    assert not path.with_suffix(".md").exists()  # a table is redrawn only where one was drawn
