"""``make bench-compare``: a ratio that got worse beyond the measured run-to-run spread fails.

The baseline is what ``bench/results/results.json`` holds after two runs (each ratio with its
value and its spread); the current document is one new run (``run.json``: plain values).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the bench program is not installed

from bench.compare import compare, main, ratios


def _cell(value: float | None, spread: float | None) -> dict[str, Any]:
    return {"value": value, "runs": [], "spread": spread}


BASELINE = {
    "schema": 2,
    "headline": {
        "interleaved": {
            "modeld_over_limit": _cell(1.04, 0.10),  # two runs 10% apart
            "modeld_over_llama_server": _cell(0.95, 0.02),  # two runs 2% apart: the 5% floor applies
            "decode_over_limit": _cell(1.00, 0.01),
            "http_overhead_ms": _cell(3.0, 1.0),
            "modeld_over_lcp_server": _cell(None, None),  # lcp-server did not run in the baseline
        }
    },
}


def _run(**values: float | None) -> dict[str, Any]:
    return {"schema": 2, "headline": {"interleaved": dict(values)}}


def _verdicts(current: dict[str, Any]) -> dict[str, str]:
    return {f.ratio: f.verdict for f in compare(BASELINE, current)}


def test_a_run_inside_every_spread_passes() -> None:
    current = _run(
        modeld_over_limit=1.13,  # +8.7%: inside the measured 10%
        modeld_over_llama_server=0.99,  # +4.2%: inside the 5% floor
        decode_over_limit=0.96,  # -4%: inside the floor
        http_overhead_ms=4.9,  # +1.9 ms: inside the 2 ms floor
        modeld_over_lcp_server=0.8,
    )
    assert _verdicts(current) == {
        "modeld_over_limit": "ok",
        "modeld_over_llama_server": "ok",
        "decode_over_limit": "ok",
        "http_overhead_ms": "ok",
        "modeld_over_lcp_server": "not measured",
    }


def test_each_kind_of_regression_is_flagged_in_its_own_direction() -> None:
    current = _run(
        modeld_over_limit=1.15,  # +10.6%: beyond the measured 10% (TTFT ratios: up is worse)
        modeld_over_llama_server=0.90,  # down: better, never flagged
        decode_over_limit=0.94,  # -6%: beyond the 5% floor (decode speed: down is worse)
        http_overhead_ms=5.5,  # +2.5 ms: beyond 2 ms
    )
    findings = {f.ratio: f for f in compare(BASELINE, current)}
    assert {k: f.verdict for k, f in findings.items()} == {
        "modeld_over_limit": "worse",
        "modeld_over_llama_server": "better",
        "decode_over_limit": "worse",
        "http_overhead_ms": "worse",
    }  # modeld_over_lcp_server: measured on neither side, not listed
    assert findings["modeld_over_limit"].tolerance == 0.10
    assert findings["modeld_over_llama_server"].tolerance == 0.05
    assert findings["http_overhead_ms"].tolerance == 2.0


def test_tokens_computed_again_are_an_exact_count_any_increase_is_worse() -> None:
    """``recomputed_tokens`` (the daemon's count) has no tolerance: a spread between two runs
    does not widen it, one more token is a regression."""
    baseline = {"headline": {"restart": {"recomputed_tokens": _cell(0.0, 0.0)}}}
    found = compare(
        baseline, {"headline": {"restart": {"recomputed_tokens": {"value": 1.0, "spread": 40.0}}}}
    )
    assert [(f.verdict, f.tolerance) for f in found] == [("worse", 0.0)]
    assert "(tolerance 0 tokens)" in found[0].line()
    assert compare(baseline, _run())[0].verdict == "not measured"
    assert compare(baseline, {"headline": {"restart": {"recomputed_tokens": 0.0}}})[0].verdict == "ok"


def test_the_current_documents_own_spread_widens_the_tolerance() -> None:
    merged = {"headline": {"interleaved": {"modeld_over_llama_server": _cell(1.02, 0.09)}}}
    assert _verdicts(merged)["modeld_over_llama_server"] == "ok"  # +7.4% against a 9% spread
    assert ratios(merged) == {("interleaved", "modeld_over_llama_server"): (1.02, 0.09)}


def test_the_command_exits_non_zero_on_a_regression_and_zero_without(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    baseline = tmp_path / "results.json"
    baseline.write_text(json.dumps(BASELINE))
    worse = tmp_path / "worse.json"
    worse.write_text(json.dumps(_run(modeld_over_limit=1.2)))
    same = tmp_path / "same.json"
    same.write_text(json.dumps(_run(modeld_over_limit=1.04, decode_over_limit=1.0)))

    assert main(["--baseline", str(baseline), "--current", str(worse)]) == 1
    out = capsys.readouterr()
    assert "worse        interleaved            modeld_over_limit" in out.out
    assert "1 ratio(s) got worse" in out.err

    assert main(["--baseline", str(baseline), "--current", str(same)]) == 0
    assert "no ratio got worse" in capsys.readouterr().out


# --- the overhead rows and the extras' figures ------------------------------------------------


def _overhead(
    ensure_ms: float, wire_ttft: float, worker_ttft: float, pairs: float | None = None
) -> dict[str, Any]:
    row = {"prefix_tokens": 7993.0, "prefill_suffix_ms": 0.5, "per_token_ms": 0.08}
    overhead: dict[str, Any] = {
        "in_process": {**row, "ensure_prefix_ms": ensure_ms / 2, "ttft_ms": 2.0},
        "over_the_wire": {**row, "ensure_prefix_ms": ensure_ms, "ttft_ms": wire_ttft},
        "worker_process": {**row, "ensure_prefix_ms": ensure_ms, "ttft_ms": worker_ttft, "per_token_ms": 0.1},
    }
    if pairs is not None:
        overhead["decode_pairs"] = {
            "ratio_median": pairs,
            "ratio_min": pairs - 0.01,
            "ratio_max": pairs + 0.01,
        }
    return overhead


def _extras_run(ensure_ms: float, wire_ttft: float, worker_ttft: float, **more: Any) -> dict[str, Any]:
    return {
        "schema": 2,
        "headline": {},
        "overhead": _overhead(ensure_ms, wire_ttft, worker_ttft, more.get("pairs")),
        "speculation": {
            "summary": {"rewrite_over_off": more.get("rewrite", 4.8), "best_llama_server_ngram": "x"}
        },
        "fleet": {"systems": [{"system": "modeld", "moved_over_cold": {"median": more.get("moved", 0.05)}}]},
    }


EXTRAS_BASELINE = {  # two runs: ensure_prefix 1.8 and 2.0 ms (11% apart), IPC 2.0 and 2.4 ms a turn
    "schema": 2,
    "headline": {},
    "run_docs": [_extras_run(1.8, 4.0, 6.0, pairs=0.98), _extras_run(2.0, 4.0, 6.4)],
}


def _extra_verdicts(current: dict[str, Any]) -> dict[str, str]:
    from bench.compare import compare_extras

    return {f.ratio: f.verdict for f in compare_extras(EXTRAS_BASELINE, current)}


def test_the_overhead_rows_and_the_extras_pass_inside_their_spread() -> None:
    from bench.compare import extra_figures

    figures = extra_figures(EXTRAS_BASELINE)
    assert figures[("overhead", "ensure_prefix_over_the_wire_ms")].value == pytest.approx(1.9)
    assert figures[("overhead", "ensure_prefix_over_the_wire_ms")].spread == pytest.approx(2.0 / 1.8 - 1)
    assert figures[("overhead", "worker_ipc_turn_ms")].spread == pytest.approx(0.4)  # in ms: may be near 0
    assert figures[("overhead", "decode_pairs_over_limit")].spread == pytest.approx(
        0.02 / 0.98
    )  # its own range
    current = _extras_run(2.05, 4.0, 6.6, pairs=0.95, rewrite=4.7, moved=0.052)
    verdicts = _extra_verdicts(current)
    assert set(verdicts.values()) == {"ok"}, verdicts
    assert "speculation" not in {k for k, _ in extra_figures({"headline": {}})}


def test_each_overhead_row_and_extra_is_flagged_in_its_own_direction() -> None:
    current = _extras_run(2.4, 4.0, 7.0, pairs=0.90, rewrite=3.0, moved=0.2)
    verdicts = _extra_verdicts(current)
    assert verdicts["ensure_prefix_over_the_wire_ms"] == "worse"  # +26% against an 11% spread
    assert verdicts["worker_ipc_turn_ms"] == "worse"  # 3.0 ms against 2.2 +- 0.5
    assert verdicts["decode_pairs_over_limit"] == "worse"  # paired decode: down is worse
    assert verdicts["rewrite_over_off"] == "worse"  # a speed-up: down is worse
    assert verdicts["moved_over_cold"] == "worse"  # a TTFT ratio: up is worse
    faster = _extras_run(1.0, 4.0, 4.5, pairs=1.1, rewrite=6.0, moved=0.01)
    verdicts = _extra_verdicts(faster)
    assert verdicts.pop("worker_ipc_token_ms") == "ok"  # the same 20 µs a token on both sides
    assert set(verdicts.values()) == {"better"}, verdicts
    assert _extra_verdicts({"schema": 2, "headline": {}})["moved_over_cold"] == "not measured"


def test_a_run_of_the_committed_results_is_inside_their_spread(capsys: pytest.CaptureFixture[str]) -> None:
    """On the real documents: each run a committed results.json merges lies inside the spread of
    its overhead rows, and the command prints them."""
    from bench.compare import compare_extras

    committed = Path(__file__).resolve().parents[2] / "bench" / "results" / "results.json"
    merged = json.loads(committed.read_text())
    assert merged["run_docs"] and all(run.get("overhead") for run in merged["run_docs"])
    for run in merged["run_docs"]:
        findings = compare_extras(merged, run)
        assert {f.ratio for f in findings} >= {"ensure_prefix_over_the_wire_ms", "worker_ipc_turn_ms"}
        assert "worse" not in {f.verdict for f in findings}, [f.line() for f in findings]
    assert main(["--baseline", str(committed), "--current", str(committed)]) == 0
    assert "ensure_prefix_worker_process_ms" in capsys.readouterr().out


def test_a_worse_overhead_row_fails_the_command(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    baseline = tmp_path / "results.json"
    baseline.write_text(json.dumps(EXTRAS_BASELINE))
    worse = tmp_path / "run.json"
    worse.write_text(json.dumps(_extras_run(1.9, 4.0, 9.0)))
    assert main(["--baseline", str(baseline), "--current", str(worse)]) == 1
    out = capsys.readouterr()
    assert "worse        overhead               worker_ipc_turn_ms" in out.out
    assert "got worse" in out.err


def _families_run(modeld_ttft: float, modeld_turn2: int) -> dict[str, Any]:
    """A families run file (``bench/results/families/run-*.json``): one family, two turns."""

    def record(system: str, turn: int, ttft: float, computed: int) -> dict[str, Any]:
        return {"system": system, "turn": turn, "ttft_s": ttft, "first_chunk_s": ttft, "computed_tokens": computed,
                "prompt_ms": ttft * 900, "error": ""}  # fmt: skip

    records = [
        record("modeld", 0, 9.0, 2000),
        record("llama-server", 0, 9.0, 2000),
        record("modeld", 1, modeld_ttft, modeld_turn2),
        record("llama-server", 1, 1.0, 400),
    ]
    return {"id": "x", "families": {"families": {"qwen3": {"records": records, "notes": []}}}}


def test_the_families_rows_are_compared(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from bench.compare import compare_extras, extra_figures

    runs = {"run_docs": [_families_run(0.6, 400), _families_run(0.7, 400)]}  # 17% apart
    figures = extra_figures(runs)
    assert figures[("families", "qwen3_ttft_ratio")].value == pytest.approx(0.65)
    assert figures[("families", "qwen3_ttft_ratio")].spread == pytest.approx(0.7 / 0.6 - 1)
    assert figures[("families", "qwen3_computed_ratio")].value == pytest.approx(2400 / 2400)
    verdicts = {f.ratio: f.verdict for f in compare_extras(runs, _families_run(0.74, 400))}
    assert verdicts == {"qwen3_ttft_ratio": "ok", "qwen3_computed_ratio": "ok"}
    verdicts = {f.ratio: f.verdict for f in compare_extras(runs, _families_run(0.9, 600))}
    assert verdicts == {"qwen3_ttft_ratio": "worse", "qwen3_computed_ratio": "worse"}
    paths = []
    for k, run in enumerate([_families_run(0.6, 400), _families_run(0.7, 400), _families_run(0.9, 600)]):
        paths.append(tmp_path / f"run-{k}.json")
        paths[-1].write_text(json.dumps(run))
    assert main(["--baseline", str(paths[0]), str(paths[1]), "--current", str(paths[1])]) == 0
    assert main(["--baseline", str(paths[0]), str(paths[1]), "--current", str(paths[2])]) == 1
    assert "worse        families               qwen3_ttft_ratio" in capsys.readouterr().out


def test_a_family_whose_ttft_never_compares_is_compared_on_the_servers_prefill() -> None:
    from bench.compare import compare_extras, extra_figures

    def refused(modeld_prefill_ms: float) -> dict[str, Any]:  # llama-server's parser refused every turn
        run = _families_run(0.5, 400)
        for r in run["families"]["families"]["qwen3"]["records"]:
            if r["system"] == "llama-server":
                r["error"] = "stream error: the model produced output that does not match the expected format"
            elif r["turn"] == 1:
                r["prompt_ms"] = modeld_prefill_ms  # llama-server's: 900 ms
        return run

    figures = extra_figures(refused(450.0))
    assert ("families", "qwen3_ttft_ratio") not in figures
    assert figures[("families", "qwen3_prefill_ratio")].value == pytest.approx(0.5)
    verdicts = {f.ratio: f.verdict for f in compare_extras(refused(450.0), refused(900.0))}
    assert verdicts == {"qwen3_prefill_ratio": "worse", "qwen3_computed_ratio": "ok"}
