"""The real-model figures of README.md, docs/results.md and docs/benchmarks.md are what the
records in docs/runs/real/ give: tables as their commands print them, the figures in
prose recomputed here. Prose is compared with its line breaks taken out, so rewrapping
a paragraph passes and changing a number fails."""
import json
import re
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

from minisparse.evaluation.paired import (Difference, paired_differences, paired_test,
                                          score_difference)
from minisparse.plot import evals
from minisparse.plot.compare import comparison_tables
from minisparse.plot.curves import group_runs
from minisparse.plot.metrics import read_metrics
from minisparse.plot.table import results_tables, run_mean

REPO = Path(__file__).resolve().parents[1]
RUNS = REPO / "docs" / "runs" / "real"
RESULTS = (REPO / "docs" / "results.md").read_text()
BENCHMARKS = (REPO / "docs" / "benchmarks.md").read_text()
README = (REPO / "README.md").read_text()
SEEDS = {"dense": (1, 2, 3), "rkv": (1, 2, 3), "rkv_naive": (1, 2), "rkv_geo": (1, 2)}
NAMES = [f"{v}_seed{s}" for v, seeds in SEEDS.items() for s in seeds]
ROWS = {name: read_metrics(RUNS / name) for name in NAMES}
COMPRESSED = [name for name in NAMES if not name.startswith("dense")]


def _prose(text: str) -> str:
    """text with every run of white space one space: line breaks do not count."""
    return " ".join(text.split())


def _says(doc: str, *phrases: str) -> None:
    for phrase in phrases:
        assert _prose(phrase) in _prose(doc), phrase


def _doc_row(text: str, label: str) -> str:
    """The first Markdown table row of text that starts with label ("| ..."), or whose
    first cell names it."""
    return next(line for line in text.splitlines() if line.startswith("| ") and (
        line.startswith(label) if label.startswith("| ") else label in line.split(" | ")[0]))


def _cells(row: str) -> list[str]:
    return [c.strip() for c in row.strip("| \n").split(" | ")]


def _values(name: str, key: str, first: int = 1, last: int = 30) -> list[float]:
    return [r[key] for r in ROWS[name] if key in r and first <= r["rollout"] <= last]


def _variant_mean(variant: str, key: str, reduce=None) -> float:
    return statistics.mean(run_mean(ROWS[f"{variant}_seed{s}"], key, 30, reduce)
                           for s in SEEDS[variant])


def _score(name: str, rollout: int) -> float:
    [row] = [r for r in ROWS[name] if r["rollout"] == rollout]
    return row["eval/math500/accuracy"]


def test_the_ablation_table_is_the_records():
    """Every cell of the held-out table that `minisparse.plot --group --table` prints
    appears, in order, in the docs' row of that variant."""
    printed = results_tables(group_runs(ROWS))
    labels = {"dense": "| dense", "rkv": "(`rkv`)", "rkv_naive": "(`rkv_naive`)",
              "rkv_geo": "(`rkv_geo`)"}
    for variant, label in labels.items():
        mine = _cells(_doc_row(printed, f"| {variant} |"))
        doc = " | ".join(_cells(_doc_row(RESULTS, label))).replace("**", "")
        assert re.search(".*".join(map(re.escape, mine[1:])), doc), (variant, mine, doc)
        seeds = ", ".join(f"{100 * _score(f'{variant}_seed{s}', 30):.1f}" for s in SEEDS[variant])
        assert doc.endswith(f"({seeds})")


def test_each_variant_against_dense_is_printed_verbatim():
    """The paired and the scores-alone tables, from the samples kept at rollout 30."""
    table = comparison_tables({name: RUNS / name for name in NAMES})
    assert table and table in RESULTS
    assert "| rkv | 30 | - | +2.5 ± 2.9 | +1.3 ± 2.9 | +1.9 ± 2.2 (1,000 pairs) | 0.09 " in table


def _paired(variant: str, seeds: tuple[int, ...]) -> Difference:
    """variant minus dense at rollout 30 over these seeds' kept samples."""
    graded = {name: evals.read_per_problem(RUNS / name / "eval" / "rollout_000030", "math500")
              for name in (f"{v}_seed{s}" for v in ("dense", variant) for s in seeds)}
    return paired_test([paired_differences(graded[f"dense_seed{s}"], graded[f"{variant}_seed{s}"])
                        for s in seeds])


def _unpaired(variant: str) -> Difference:
    def score(name: str) -> tuple[float, float]:
        [row] = [r for r in ROWS[name] if r["rollout"] == 30]
        return row["eval/math500/accuracy"], row["eval/math500/accuracy_ci95"]

    return score_difference([(score(f"dense_seed{s}"), score(f"{variant}_seed{s}"))
                             for s in SEEDS[variant]])


def test_the_statistics_sentences_are_the_records():
    """At rollout 30: rkv paired over seeds 2 and 3, the others over seed 2, each from the
    scores of all its seeds; one-sided bounds to 0.01 point, as the tables print them."""
    rkv = _paired("rkv", (2, 3))
    bound = {v: f"{100 * _paired(v, (2,)).lower_bound:+.2f}" for v in ("rkv_naive", "rkv_geo")}
    scores = {v: f"{100 * _unpaired(v).lower_bound:+.2f}" for v in SEEDS if v != "dense"}
    _says(RESULTS, f"Paired over seeds 2 and 3 it is {100 * rkv.mean:+.1f} ± {100 * rkv.ci95:.1f} "
          f"points ({rkv.count:,} pairs, two-sided p = {rkv.p_value:.2f}), its one-sided lower "
          f"bound {100 * rkv.lower_bound:+.2f} above the -2 margin; from the scores of all three "
          f"seeds the bound is {scores['rkv']}, the same verdict",
          f"(bounds {bound['rkv_naive']} and {bound['rkv_geo']}, seed 2)",
          f"naive R-KV's bound is {scores['rkv_naive']} and geometric rejection's "
          f"{scores['rkv_geo']}, which does not clear it")
    assert rkv.non_inferior(0.02) and _unpaired("rkv_naive").non_inferior(0.02)
    assert not _unpaired("rkv_geo").non_inferior(0.02)


def test_readmes_learning_sentence_is_the_records():
    """README's one sentence on learning: each variant's mean MATH500 at rollout 30."""
    mean = {v: 100 * statistics.mean(_score(f"{v}_seed{s}", 30) for s in SEEDS[v])
            for v in ("dense", "rkv")}
    _says(README, f"to {mean['dense']:.1f}% with dense rollouts and to {mean['rkv']:.1f}% "
          "with R-KV and the paper's corrections")


def test_the_cost_table_is_the_records():
    """Each variant's mean over its seeds of each run's mean over rollouts 1-30."""
    table = RESULTS[RESULTS.index("Costs, each run's mean"):RESULTS.index("Per 10-rollout window")]
    dense_seq = _variant_mean("dense", "compress/peak_cache_tokens_mean")
    dense_once = _variant_mean("dense", "perf/peak_kv_tokens", max)
    for variant in SEEDS:
        seq = _variant_mean(variant, "compress/peak_cache_tokens_mean")
        once = _variant_mean(variant, "perf/peak_kv_tokens", max)
        relative = variant != "dense"
        expect = [
            f"{100 * _variant_mean(variant, 'rollout/accuracy'):.1f}%",
            f"{_variant_mean(variant, 'compress/compressed_token_frac'):.2f}",
            f"{_variant_mean(variant, 'mismatch/kl_k1'):.4f}",
            f"{_variant_mean(variant, 'rs/kept_token_frac'):.2f}",
            f"{_variant_mean(variant, 'rs/vetoed_frac'):.2f}",
            f"{seq:,.0f}" + (f" ({seq / dense_seq:.2f})" if relative else ""),
            f"{once:,.0f}" + (f" ({once / dense_once:.2f})" if relative else ""),
            f"{_variant_mean(variant, 'perf/rollout_tokens_per_s'):,.0f}",
            f"{_variant_mean(variant, 'time/step_s'):.1f}"]
        label = "| dense |" if variant == "dense" else f"| `{variant}` |"
        assert _cells(_doc_row(table, label))[1:] == expect, variant


def _range(values: list[float], fmt: str) -> str:
    return f"{fmt.format(min(values))}-{fmt.format(max(values))}"


def test_the_compression_and_cost_sentences_are_the_records():
    per_rollout = [v for n in COMPRESSED for v in _values(n, "compress/compressed_token_frac")]
    windows = [statistics.mean(_values(n, "compress/compressed_token_frac", a, a + 9))
               for n in COMPRESSED for a in (1, 11, 21)]
    peaks = [v for n in COMPRESSED for v in _values(n, "compress/peak_cache_tokens_mean")]
    _says(RESULTS, f"the compressed-token share is {_range(windows, '{:.2f}')} in every window "
          f"of every compressed run ({_range(per_rollout, '{:.2f}')} a single rollout)",
          f"put {_range(per_rollout, '{:.2f}')} of response tokens after their sequence's "
          f"first eviction in every rollout of every run, at a peak of "
          f"{_range(peaks, '{:.0f}')} cached tokens a sequence")
    spread = {"acc": [], "step": [], "kv": []}
    for variant, seeds in SEEDS.items():
        runs = [ROWS[f"{variant}_seed{s}"] for s in seeds]
        for key, name, scale in (("acc", "rollout/accuracy", 100), ("step", "time/step_s", 1)):
            means = [scale * run_mean(r, name, 30) for r in runs]
            spread[key].append(max(means) - min(means))
        kv = [run_mean(r, "compress/peak_cache_tokens_mean", 30) for r in runs]
        spread["kv"].append((max(kv) - min(kv)) / statistics.mean(kv))
    _says(RESULTS, f"the seeds of a variant differ by at most {max(spread['acc']):.1f} point of "
          f"training accuracy, {max(spread['step']):.1f} s a step and "
          f"{100 * max(spread['kv']):.1f}% of KV a sequence")
    vetoes = [v for s in SEEDS["rkv"] for v in _values(f"rkv_seed{s}", "rs/vetoed_frac")]
    _says(RESULTS, f"the veto drops {100 * _variant_mean('rkv', 'rs/vetoed_frac'):.0f}% of "
          f"sequences ({_range([100 * v for v in vetoes], '{:.0f}')}% a rollout) and token "
          f"rejection leaves {100 * _variant_mean('rkv', 'rs/kept_token_frac'):.0f}% of the tokens")
    assert all(v == 0 for s in SEEDS["rkv_geo"]
               for v in _values(f"rkv_geo_seed{s}", "rs/rejected_seq_frac"))  # "rejects nothing"


def test_the_step_time_ratios_are_the_records():
    """README's headline row and the speed sentences: dense / R-KV of the step's mean."""
    step = {v: _variant_mean(v, "time/step_s") for v in SEEDS}
    dense_12 = statistics.mean(run_mean(ROWS[f"dense_seed{s}"], "time/step_s", 30)
                               for s in (1, 2))
    own = [step["dense"] / step["rkv"]]
    own += [dense_12 / step[v] for v in ("rkv_naive", "rkv_geo")]
    against_all = [step["dense"] / step[v] for v in ("rkv", "rkv_naive", "rkv_geo")]
    _says(README, f"| {step['dense']:.1f} s | {step['rkv']:.1f} s | "
          f"{step['dense'] / step['rkv']:.2f}x |")
    _says(RESULTS, f"`rkv` {step['rkv']:.1f} s against dense's {step['dense']:.1f} s over three "
          f"seeds, dense / R-KV {own[0]:.2f}x; naive and geometric {step['rkv_naive']:.1f} and "
          f"{step['rkv_geo']:.1f} s against {dense_12:.1f} s over their two seeds, "
          f"{own[1]:.2f}x and {own[2]:.2f}x")
    _says(BENCHMARKS, f"dense {step['dense']:.1f} s a step against R-KV's "
          f"{_range([step[v] for v in ('rkv', 'rkv_naive', 'rkv_geo')], '{:.1f}')} s (dense / "
          f"R-KV {_range(against_all, '{:.2f}')}x; {_range(own, '{:.2f}')}x against each "
          "variant's own seeds of dense)")


def test_the_held_out_sentences_are_the_records():
    gains = {v: statistics.mean(_score(f"{v}_seed{s}", 30) - _score(f"{v}_seed{s}", 0)
                                for s in seeds) for v, seeds in SEEDS.items()}
    _says(RESULTS, f"{100 * gains['dense']:.1f} points (dense), {100 * gains['rkv_naive']:.1f} "
          f"(`rkv_naive`), {100 * gains['rkv']:.1f} (`rkv`) and {100 * gains['rkv_geo']:.1f} "
          "(`rkv_geo`), each the mean of its seeds' gains")
    gaps = [_score(f"rkv_seed{s}", 30) - _score(f"dense_seed{s}", 30) for s in (1, 2, 3)]
    _says(RESULTS, "It ends above dense in all three seeds (" + ", ".join(
        f"{100 * g:+.1f}" for g in gaps) + " points)")
    assert all(_score(n, 30) >= _score(f"dense_seed{n[-1]}", 30) for n in COMPRESSED)
    before = [_score(n, 0) for n in NAMES]
    tokens = [r["eval/math500/mean_response_tokens"] for n in NAMES for r in ROWS[n]
              if r["rollout"] == 0]
    widths = [r["eval/math500/accuracy_ci95"] for n in NAMES for r in ROWS[n]
              if r["rollout"] == 0]
    _says(RESULTS, f"| {_range([100 * b for b in before], '{:.1f}')} ± "
          f"{_range([100 * w for w in widths], '{:.1f}')}% ({_range(tokens, '{:.0f}')} tokens) |",
          f"the model scores {_range([100 * b for b in before], '{:.1f}')}% on MATH500")
    same_weights = [abs(_score(n, 0) - _score(f"dense_seed{n[-1]}", 0)) for n in COMPRESSED]
    _says(RESULTS, f"their scores still differ by up to {100 * max(same_weights):.1f} points")


def test_the_mismatch_sentences_are_the_records():
    def kl(name: str, first: int) -> float:
        return statistics.mean(_values(name, "mismatch/kl_k1", first, first + 9))

    def change(name: str) -> str:
        return f"{kl(name, 1):.3f} to {kl(name, 21):.3f}"

    _says(RESULTS, f"rises from {kl('rkv_naive_seed1', 1):.3f} and {kl('rkv_naive_seed2', 1):.3f}"
          f" (seeds 1, 2; rollouts 1-10) to {kl('rkv_naive_seed1', 21):.3f} and "
          f"{kl('rkv_naive_seed2', 21):.3f} (rollouts 21-30)",
          f"`rkv` eased in seed 1 ({change('rkv_seed1')}) and rose in seeds 2 and 3 "
          f"({change('rkv_seed2')}, {change('rkv_seed3')}); `rkv_geo` eased in both "
          f"({change('rkv_geo_seed1')}, {change('rkv_geo_seed2')})")
    corrected = [kl(n, 21) - kl(n, 1) for n in COMPRESSED if "naive" not in n]
    _says(RESULTS, f"The corrected runs move by {min(corrected):+.3f} to {max(corrected):+.3f}")
    assert all(kl(n, 21) > kl(n, 1) for n in COMPRESSED if "naive" in n)


def _window(variant: str, key: str, first: int, scale: float = 1.0) -> float:
    """The variant's mean over seeds of each run's mean over rollouts first..first + 9."""
    return statistics.mean(scale * statistics.mean(_values(f"{variant}_seed{s}", key, first,
                                                           first + 9)) for s in SEEDS[variant])


def test_the_window_sentences_are_the_records():
    def by_window(variant: str) -> str:
        return ", ".join(f"{_window(variant, 'mismatch/kl_k1', a):.3f}" for a in (1, 11, 21))

    compressed = ("rkv_naive", "rkv", "rkv_geo")
    accuracy = {a: [_window(v, "rollout/accuracy", a, 100) for v in compressed]
                for a in (1, 11, 21)}
    _says(RESULTS, f"the mismatch KL of naive R-KV goes {by_window('rkv_naive')} by window, of "
          f"`rkv` {by_window('rkv')}, of `rkv_geo` {by_window('rkv_geo')}; training accuracy "
          "goes " + ", ".join(f"{_window('dense', 'rollout/accuracy', a, 100):.1f}"
                              for a in (1, 11, 21))
          + "% for dense and " + ", ".join(_range(accuracy[a], "{:.1f}") for a in (1, 11, 21))
          + "% for the compressed variants")
    over_run = [100 * _variant_mean(v, "rollout/accuracy") for v in compressed]
    _says(RESULTS, f"({_range(over_run, '{:.1f}')}% against dense's "
          f"{100 * _variant_mean('dense', 'rollout/accuracy'):.1f}% over the run; "
          f"{_range(accuracy[21], '{:.1f}')}% against "
          f"{_window('dense', 'rollout/accuracy', 21, 100):.1f}% in rollouts 21-30)")
    speed = [_variant_mean(v, "perf/rollout_tokens_per_s") / 1000 for v in compressed]
    _says(RESULTS, f"its rollout samples {_range(speed, '{:.1f}')}k tokens/s against dense's "
          f"{_variant_mean('dense', 'perf/rollout_tokens_per_s') / 1000:.1f}k")
    final = {v: statistics.mean(_score(f"{v}_seed{s}", 30) for s in SEEDS[v]) for v in SEEDS}
    rkv_12 = statistics.mean(_score(f"rkv_seed{s}", 30) for s in (1, 2))
    _says(RESULTS, f"({100 * (final['rkv'] - final['rkv_naive']):.1f} points over naive, "
          f"{100 * (rkv_12 - final['rkv_naive']):.2f} over the same two seeds")


def test_the_first_rollouts_groups_are_the_records():
    mixed = [32 - r["advantage/zero_signal_groups"] for s in SEEDS["dense"]
             for r in ROWS[f"dense_seed{s}"] if r["rollout"] == 1]
    _says(RESULTS, ", ".join(f"{100 * m / 32:.0f}%" for m in mixed[:-1])
          + f" and {100 * mixed[-1] / 32:.0f}% of its groups ("
          + ", ".join(f"{m:.0f}" for m in mixed[:-1]) + f" and {mixed[-1]:.0f} of 32)")


def _pair_table(*names: str) -> str:
    pairs = [str(RUNS / "pair" / name) for name in names]
    return subprocess.run([sys.executable, "-m", "scripts.pair_table", *pairs], cwd=REPO,
                          capture_output=True, text=True, check=True).stdout


def _same_cells(printed: str, doc: str) -> None:
    mine = _cells(printed)[2:]
    assert [c.removesuffix(" s") for c in _cells(doc)[2:]] == [
        c if c != "0.00" else "0" for c in mine]


def test_the_step_pair_medians_are_the_records():
    out = _pair_table(*(f"h200_real_{i}" for i in range(1, 6)))
    for run, label in (("compressed", "| R-KV | real, median of 5"),
                       ("dense", "| dense | real, median of 5")):
        _same_cells(_doc_row(out, f"| median of 5 | {run}"), _doc_row(BENCHMARKS, label))
    random = _pair_table("h200_random")
    for run, label in (("compressed", "| R-KV | random"), ("dense", "| dense | random")):
        _same_cells(_doc_row(random, f"| h200_random | {run}"), _doc_row(BENCHMARKS, label))
    ratio = out.splitlines()[-1]
    assert ratio.startswith("median of 5 pairs: dense / compressed 1.15x a step (0.96-1.30x), "
                            "1.22x a rollout")
    _says(BENCHMARKS, "1.15x a step (median of five pairs; 0.96-1.30x), 1.22x a rollout")


def test_the_benchmarks_after_training_are_printed_verbatim():
    final = RUNS / "final"
    table = evals.compare_folders({"dense": final / "dense_seed2", "rkv": final / "rkv_seed2"})
    assert table in RESULTS


BASE = {path.stem: json.loads(path.read_text())["benchmarks"]
        for path in sorted((RUNS / "base").glob("*.json"))}


def test_the_base_models_figures_are_their_records():
    """Every score of docs/runs/real/base/JOB.json (eval.py's summaries) is in the table
    of the base models as eval.py prints it; the sampled jobs' mean lengths and truncated
    shares too, the greedy ones' MATH500 lengths in the prose below it."""
    from minisparse.evaluation.scores import percent_with_interval

    section = RESULTS[RESULTS.index("### Why this model"):RESULTS.index("### Commands")]
    table = section[:section.index("± is the half-width")]
    for job, benchmarks in BASE.items():
        for name, m in benchmarks.items():
            assert f"{percent_with_interval(m, '±')}%" in table, (job, name)
            if not job.startswith("greedy"):
                assert f"{m['mean_response_tokens']:,.0f}" in table, (job, name)
                assert f"{100 * m['truncated_fraction']:.1f}%" in table, (job, name)
    math500 = [b["math500"] for job, b in BASE.items() if job.startswith(("greedy", "protocol"))]
    cut = [100 * m["truncated_fraction"] for m in math500]
    greedy = [BASE[f"greedy_{s}"]["math500"]["mean_response_tokens"] for s in ("0.5b", "1.5b")]
    _says(section, f"{_range(cut, '{:.0f}')}% of MATH500 answers run to the 8,192-token limit "
          f"(greedy: mean {_range(greedy, '{:,.0f}')} tokens")
    assert {m["max_new_tokens"] for m in math500} == {8192}
    costs = {bench: [100 * (BASE[f"greedy_{s}"][bench]["accuracy"]
                            - BASE[f"protocol_{s}"][bench]["accuracy"]) for s in ("0.5b", "1.5b")]
             for bench in ("math500", "gsm8k")}
    _says(section, f"costs {_range(costs['math500'], '{:.1f}')} points of MATH500 and "
          f"{_range(costs['gsm8k'], '{:.1f}')} of GSM8K against greedy")
    ends = [100 - 100 * BASE[f"train_{s}"]["simplelr_qwen_level3to5"]["truncated_fraction"]
            for s in ("1.5b", "0.5b")]
    _says(section, f"it ends {ends[0]:.1f}% of its answers (the 0.5B {ends[1]:.1f}%)")


BENCH_PAIRS = REPO / "docs" / "runs" / "bench" / "pairs"


def _step_median(pair: str, run: str, rollouts: tuple[int, ...],
                 key: str = "time/step_s") -> float:
    """The median of `key` (step seconds) over `rollouts` of a bench pair's run (dense,
    sparse)."""
    rows = [r for r in read_metrics(BENCH_PAIRS / pair / run) if r["rollout"] in rollouts]
    assert len(rows) == len(rollouts), (pair, run)
    return statistics.median(r[key] for r in rows)


@pytest.mark.parametrize("pair,rollouts,label", [
    ("qwen1.5b_random_24gb_10k", (2, 3),
     "| GRPO step, CPU Adam, liger-kernel + flash-attn-4, median of rollouts 2-3"),
    ("qwen1.5b_random_24gb_1024_halves_at_once_10k", (1,), "| GRPO step of those 1,024"),
    ("qwen1.5b_real_24gb_compaction_ahead", (2, 3, 4),
     "| GRPO step, CPU Adam, liger-kernel + flash-attn-4, median of rollouts 2-4"),
    ("coder1.5b_real_compaction_ahead", (2, 3, 4),
     "| GRPO step, liger-kernel + flash-attn-4, median"),
    ("qwen1.5b_real_24gb_1024_grading_beside_logprobs", (2,), "| GRPO step of 1,024 samples"),
    ("qwen3b_random_one_after_the_other", (2, 3),
     "| GRPO step, liger-kernel + flash-attn-4, median of rollouts 2-3, the runs one after"),
])
def test_the_step_pair_rows_are_their_records(pair, rollouts, label):
    """README's step pairs: dense, R-KV, their ratio, and the rollouts' where it is given."""
    dense, sparse = (_step_median(pair, run, rollouts) for run in ("dense", "sparse"))
    row = _cells(_doc_row(README, label))
    assert row[4:6] == [f"{dense:.1f} s", f"{sparse:.1f} s"]
    ratio, _, rollout = row[6].partition(" (rollout ")
    assert ratio == f"{dense / sparse:.2f}x"
    if rollout:
        d, s = (_step_median(pair, run, rollouts, "time/rollout_s") for run in ("dense", "sparse"))
        assert rollout == f"{d / s:.2f}x)"


def test_the_3b_phase_table_is_its_records():
    """The phases of the 3B pair, rollouts 2 / 3 (rollout 1's step in brackets)."""
    section = BENCHMARKS[BENCHMARKS.index("### A GRPO step at the paper's per-GPU shape"):]
    runs = {run: {m["rollout"]: m for m in read_metrics(
        BENCH_PAIRS / "qwen3b_random_one_after_the_other" / run)} for run in ("dense", "sparse")}

    def two(run: str, key: str, fmt: str) -> str:
        return " / ".join(fmt.format(runs[run][n][key]) for n in (2, 3))

    for col, run in enumerate(("dense", "sparse"), start=1):
        assert _cells(_doc_row(section, "| rollout |"))[col].startswith(
            f"{two(run, 'time/rollout_s', '{:.1f}')} s "
            f"({two(run, 'perf/rollout_tokens_per_s', '{:,.0f}')} tokens/s")
        assert _cells(_doc_row(section, "| **step** |"))[col] == (
            f"**{two(run, 'time/step_s', '{:.1f}')} s** ({runs[run][1]['time/step_s']:.1f})")
    ratios = " / ".join(f"{runs['dense'][n]['time/step_s'] / runs['sparse'][n]['time/step_s']:.2f}x"
                        for n in (2, 3))
    assert _doc_row(section, "| **dense / R-KV** |").endswith(f"| **{ratios}** |")


def _phase_cells(r: dict) -> list[str]:
    """A one-rollout step row's cells after its label, as docs/benchmarks.md prints them:
    rollout (tokens/s, preemptions), log-probs, update (MFU), step."""
    preempted = f"{r['perf/preemptions']:,.0f} preemptions" if r["perf/preemptions"] else "none"
    return [f"{r['time/rollout_s']:.1f} s ({r['perf/rollout_tokens_per_s']:,.0f} tokens/s, "
            f"{preempted})", f"{r['time/logprobs_s']:.1f} s",
            f"{r['time/update_s']:.1f} s ({100 * r['perf/update_mfu']:.0f}%)",
            f"{r['time/step_s']:.1f} s"]


@pytest.mark.parametrize("pair,which,rollouts", [
    ("qwen1.5b_real_24gb_1024_compaction_ahead", "", (1, 2)),
    ("qwen1.5b_real_24gb_1024_slots", "1,024 slots, ", (2,)),
    ("qwen1.5b_real_24gb_1024_grading_beside_logprobs", "grading beside the log-probs, ", (1, 2)),
])
def test_the_real_1024_sample_table_is_its_records(pair, which, rollouts):
    """The real-weight rows of "One GPU, the paper's whole rollout", and their ratios."""
    table = BENCHMARKS[BENCHMARKS.index("| 1,024 real samples, 24 GB |"):]
    steps = {}
    for run, label in (("dense", "dense"), ("sparse", "R-KV")):
        for r in read_metrics(BENCH_PAIRS / pair / run):
            steps[run, r["rollout"]] = r
            assert r["perf/preemptions"] == 0
            if r["rollout"] in rollouts:
                row = _doc_row(table, f"| {label}, {which}rollout {r['rollout']} |")
                assert [c.replace("*", "") for c in _cells(row)][1:] == _phase_cells(r)
    ratios = {n: [steps["dense", n][k] / steps["sparse", n][k]
                  for k in ("time/step_s", "time/rollout_s")] for n in (1, 2)}
    if not which:
        _says(BENCHMARKS, "{:.2f}x at rollout 1 ({:.2f}x)".format(*ratios[1]),
              "**{:.2f}x** dense's at rollout 2 (its rollout {:.2f}x)".format(*ratios[2]))
    elif which.startswith("grading"):
        _says(BENCHMARKS, "**{:.2f}x** dense's at rollout 2".format(ratios[2][0]),
              "rollout {:.2f}x) and {:.2f}x at rollout 1".format(ratios[2][1], ratios[1][0]))


def test_the_grading_table_is_its_records():
    """"Grading while the log-probs run": the reward phase's wait and the step, rollouts
    2-4 of the four rounds, before and after."""
    root = REPO / "docs" / "runs" / "bench" / "grading_beside_logprobs"

    def cell(key: str, side: str, fmt: str) -> str:
        """"median s (range)" of key over the side's rollouts 2-4."""
        values = [r[key] for n in range(1, 5)
                  for r in read_metrics(root / f"round{n}" / side) if r["rollout"] > 1]
        return f"{fmt.format(statistics.median(values))} s ({_range(values, fmt)})"

    for label, key, formats in (("| `time/reward_s`", "time/reward_s", ("{:.2f}", "{:.3f}")),
                                ("| step |", "time/step_s", ("{:.2f}", "{:.2f}"))):
        row = [c.replace("*", "") for c in _cells(_doc_row(BENCHMARKS, label))[1:]]
        assert row == [cell(key, side, fmt) for side, fmt in zip(("before", "after"), formats)]


@pytest.mark.parametrize("budget", ["8,192", "10,240"])
def test_the_1024_sample_step_table_is_its_records(budget):
    """The rows of "One GPU, the paper's whole rollout": each phase of the one rollout."""
    pair = BENCH_PAIRS / f"qwen1.5b_random_24gb_1024_halves_at_once_{budget[:-4]}k"
    for run, label in (("dense", "dense"), ("sparse", "R-KV")):
        (r,) = read_metrics(pair / run)
        cells = [c.replace("*", "") for c in _cells(_doc_row(BENCHMARKS, f"| {label}, {budget} |"))]
        assert cells[1:] == _phase_cells(r)


def test_the_prefill_kernel_table_is_the_record():
    runs = json.loads((REPO / "docs/runs/bench/prefill_sdpa_real_1024.json").read_text())["runs"]
    arms = {arm: [r for r in runs if r["arm"] == arm] for arm in ("torch", "engine")}

    def median(arm, key):
        return statistics.median(r[key] for r in arms[arm])

    def spread(arm, key, fmt):
        return _range([r[key] for r in arms[arm]], fmt)

    for arm, label in (("torch", "torch's pick (cuDNN)"), ("engine", "memory-efficient")):
        cells = [c.replace("**", "") for c in _cells(_doc_row(BENCHMARKS, label))]
        assert cells[1:] == [
            f"{median(arm, 'wall_s'):.2f} s ({spread(arm, 'wall_s', '{:.2f}')})",
            f"{median(arm, 'prefill_s'):.2f} s",
            f"{median(arm, 'prefill_ms_per_step'):.0f} ms ({spread(arm, 'prefill_ms_per_step', '{:.0f}')})",
            f"{median(arm, 'decode_s'):.2f} s"]
    pairs = [t["wall_s"] / e["wall_s"] for t, e in zip(arms["torch"], arms["engine"])]
    _says(BENCHMARKS,
          f"the rollout **{median('torch', 'wall_s') / median('engine', 'wall_s'):.2f}x** faster "
          f"({min(pairs):.2f}-{max(pairs):.2f}x a pair), prefill "
          f"{median('torch', 'prefill_s') / median('engine', 'prefill_s'):.1f}x")
