"""`hetero compile -m`: Hydra sweep expansion, and a real 2 x 2 sweep of the tiny model through the CLI
whose table and sweep.csv are checked against each point's own plan.json (one point fails on purpose)."""

from __future__ import annotations

import csv
import json
import re
import typing
from pathlib import Path

import pytest

from hetero import cli
from hetero.cli.sweep import CSV_COLUMNS, SUMMARY_KEYS, TABLE_COLUMNS, PlanSummary, expand, refuse_sweeps
from hetero.config import compose_raw
from hetero.errors import ConfigError

# --- expansion ------------------------------------------------------------------------------------------


def test_expand_is_the_cartesian_product_in_hydra_order_and_keeps_lists_whole() -> None:
    sweep = expand(["model=tiny", "hardware.num_devices=1,2", "lora.target_modules=[q_proj,v_proj]",
                    "train.num_micro_batches=range(2,7,4)", "output=sweeps/x"])
    assert sweep.keys == ("hardware.num_devices", "train.num_micro_batches")
    assert sweep.output == Path("sweeps/x")
    assert [p.values for p in sweep.points] == [
        (("hardware.num_devices", "1"), ("train.num_micro_batches", "2")),
        (("hardware.num_devices", "1"), ("train.num_micro_batches", "6")),
        (("hardware.num_devices", "2"), ("train.num_micro_batches", "2")),
        (("hardware.num_devices", "2"), ("train.num_micro_batches", "6")),
    ]  # the first swept key varies slowest
    assert [p.number for p in sweep.points] == [1, 2, 3, 4]
    assert sweep.points[1].overrides == ("model=tiny", "hardware.num_devices=1",
                                         "lora.target_modules=[q_proj,v_proj]", "train.num_micro_batches=6",
                                         "output=sweeps/x")
    assert sweep.points[1].name == "hardware.num_devices=1,train.num_micro_batches=6"
    assert sweep.fixed == ("model=tiny", "lora.target_modules=[q_proj,v_proj]", "output=sweeps/x")


def test_expand_choice_glob_and_directory_names() -> None:
    sweep = expand(["data.text_field=choice(text,'my field')", "data.path=a/b,a_b"])
    assert [p.values[0][1] for p in sweep.points] == ["text", "text", "my field", "my field"]
    # The override keeps Hydra's escaping, so the composed value is the one the user quoted.
    assert compose_raw([sweep.points[2].overrides[0]])["data"]["text_field"] == "my field"
    # a/b and a_b sanitize to the same directory: the later point falls back to its number.
    assert [p.name for p in sweep.points] == ["data.text_field=text,data.path=a_b", "point-02",
                                              "data.text_field=my_field,data.path=a_b", "point-04"]
    assert [p.values[0][1] for p in expand(["model=glob(llama*)"]).points] == ["llama4_scout", "llama70b", "llama8b"]
    single = expand(["model=tiny"])  # -m without a sweep: one point
    assert [(p.name, p.overrides) for p in single.points] == [("point-01", ("model=tiny",))]
    assert single.output == Path(".")  # conf/config.yaml's default


@pytest.mark.parametrize(("overrides", "message"), [
    (["output=a,b"], "output=a,b: output cannot be swept"),
    (["train.lr=1,2", "train.lr=3,4"], "train.lr is swept twice"),
    (["train.lr=interval(0,1)"], "train.lr=interval(0,1): a continuous sweep cannot be compiled"),
    (["train.lr=glob(*)"], "train.lr=glob(*): glob() picks files of a config group"),
    (["a=b=c"], "cannot read the override 'a=b=c'"),
])  # fmt: skip
def test_expand_refuses_what_it_cannot_sweep(overrides: list[str], message: str) -> None:
    with pytest.raises(ConfigError) as info:
        expand(overrides)
    assert str(info.value).startswith(message), str(info.value)


def test_a_comma_value_without_m_is_one_line_that_suggests_m(capsys: pytest.CaptureFixture[str]) -> None:
    refuse_sweeps(["lora.target_modules=[q_proj,v_proj]", "data.text_field='a,b'", "model=tiny"])  # no sweep
    code = cli.main(["compile", "hardware.num_devices=1,2", "output=never"])
    err = capsys.readouterr().err
    assert code == 2
    assert err.count("\n") == 1, err
    assert err.startswith("hetero: error: hardware.num_devices=1,2 is a sweep: add -m"), err
    assert "hetero compile -m hardware.num_devices=1,2" in err
    assert not Path("never").exists()


# --- a real sweep --------------------------------------------------------------------------------------


def _table_rows(out: str, columns: int) -> list[list[str]]:
    """The body rows of the sweep table (rich draws them between │ characters)."""
    rows = [[c.strip() for c in line.strip().strip("│").split("│")]
            for line in out.splitlines() if line.startswith("│")]
    assert all(len(r) == columns for r in rows), rows
    return rows


def test_sweep_compiles_every_point_and_compares_them(tmp_path: Path,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    # Point 2 (one device, two stages) cannot be planned: a HeteroError that must not stop points 3 and 4.
    # -m after the overrides, as Hydra users write it.
    out_dir = tmp_path / "sw"
    code = cli.main(["compile", "model=tiny", "hardware=local", "hardware.num_devices=1,2",
                     "planner.num_stages=1,2", "train.num_micro_batches=4", f"output={out_dir}", "-m"])
    captured = capsys.readouterr()
    assert code == 1, captured.err  # not every point compiled
    expected = [("1", "1"), ("1", "2"), ("2", "1"), ("2", "2")]
    names = [f"hardware.num_devices={d},planner.num_stages={s}" for d, s in expected]

    # Each compiled point's plan.json, read as plain JSON (not through the sweep's code).
    plans: dict[int, dict] = {}
    for number, ((devices, stages), name) in enumerate(zip(expected, names, strict=True), start=1):
        path = out_dir / name / "plan.json"
        if number == 2:
            assert not path.exists()
            continue
        plans[number] = data = json.loads(path.read_text())
        assert data["config"]["hardware"]["num_devices"] == int(devices)  # the point's own overrides
        assert data["planner"]["num_stages"] == int(stages)
        assert data["config"]["output"] == str(out_dir / name)
        assert len(data["stages"]) == int(stages)
    best = min(plans, key=lambda n: plans[n]["prediction"]["step_time_s"])

    # The table: one row per point with its swept values; the failed one says so; * marks the fastest.
    rows = _table_rows(captured.out, 2 + 2 + 6)
    assert [(r[2], r[3]) for r in rows] == expected
    assert [r[0] for r in rows] == ["1", "2", "3", "4"]
    assert [r[1] for r in rows] == ["*" if n == best else "" for n in range(1, 5)]
    assert rows[1][4] == "failed"
    assert f"point 2 ({names[1]}) failed: planner.num_stages=2: choose 1..1" in captured.out
    assert f"fastest predicted step: point {best} ({names[best - 1]})" in captured.out
    assert f"wrote {out_dir / 'sweep.csv'}" in captured.out
    assert "point 3/4" in captured.err  # progress per point on stderr
    assert "warning:" not in captured.out  # the tiny model leaves its devices nearly empty

    # A point whose tightest stage keeps under 5% of its memory free is warned about under the table.
    from dataclasses import replace

    from hetero.cli.sweep import Point, PointResult, headroom_lines
    from hetero.plan import Plan

    plan = Plan.load(out_dir / names[0] / "plan.json")
    stage = plan.stages[0]
    full = replace(plan, stages=[replace(stage, memory=replace(stage.memory, total_gb=stage.memory.available_gb))])
    point = Point(1, (), (), names[0])
    assert headroom_lines([PointResult(point, plan)]) == []
    assert headroom_lines([PointResult(point, full)]) == [
        f"point 1 ({names[0]}): {stage.device} keeps 0.0 GB (0%) of its memory free: it fits on paper only (a longer "
        "record, fragmentation or another process on the card tips it over); leave room: a shorter model.seq_len, a "
        "smaller train.micro_batch_size or planner.recompute=full"]

    # The CSV: a header and one row per point whose numbers are each plan.json's, to the last bit.
    with (out_dir / "sweep.csv").open(newline="") as f:
        records = list(csv.DictReader(f))
    assert [(r["hardware.num_devices"], r["planner.num_stages"]) for r in records] == expected
    assert [r["status"] for r in records] == ["ok", "error", "ok", "ok"]
    assert [r["best"] for r in records] == ["1" if n == best else "0" for n in range(1, 5)]
    assert records[1]["error"].startswith("planner.num_stages=2: choose 1..1")
    assert records[1]["step_time_s"] == "" and records[1]["plan_json"] == ""
    for number, data in plans.items():
        row = records[number - 1]
        prediction = data["prediction"]
        assert float(row["step_time_s"]) == prediction["step_time_s"]
        # tokens_per_s: trained (label) tokens/s, the tiny model's demo data measured at compile; computed beside it.
        assert float(row["tokens_per_s"]) == prediction["trained_tokens_per_s"]
        assert float(row["computed_tokens_per_s"]) == prediction["tokens_per_s"]
        assert float(row["label_fraction"]) == data["data_stats"]["label_fraction"]
        free = [s["memory"]["available_gb"] - s["memory"]["total_gb"] for s in data["stages"]]
        assert float(row["headroom_gb"]) == min(free)
        assert int(row["num_stages"]) == len(data["stages"])
        assert int(row["num_replicas"]) == max(1, len(data["replicas"]))
        single = next(b for b in data["baselines"] if b["name"] == "best_single_device")
        assert float(row["single_device_step_time_s"]) == single["prediction"]["step_time_s"]
        assert Path(row["plan_json"]) == out_dir / names[number - 1] / "plan.json"

    # The table and the CSV agree: each table cell is its column's text of the CSV row's values.
    headings = next(line for line in captured.out.splitlines() if line.startswith("┃"))
    assert [h.strip() for h in headings.strip("┃").split("┃")][4:] == [c.heading for c in TABLE_COLUMNS]
    for number in plans:
        summary = _summary_from_csv(records[number - 1])
        assert rows[number - 1][4:] == [column.text(summary) for column in TABLE_COLUMNS]


def _summary_from_csv(row: dict[str, str]) -> dict[str, object]:
    """A sweep.csv row's PlanSummary fields, typed back (an empty cell is None)."""
    hints = typing.get_type_hints(PlanSummary)
    out: dict[str, object] = {}
    for key in SUMMARY_KEYS:
        kind = next(t for t in (int, float, str) if t is hints[key] or t in typing.get_args(hints[key]))
        out[key] = None if row[key] == "" else kind(row[key])
    return out


def test_csv_table_and_docs_take_their_columns_from_one_definition() -> None:
    assert len(set(CSV_COLUMNS)) == len(CSV_COLUMNS)
    assert CSV_COLUMNS[4:-2] == SUMMARY_KEYS  # every PlanSummary field is a CSV column, in order
    shown = [key for column in TABLE_COLUMNS for key in column.keys]
    assert set(shown) <= set(SUMMARY_KEYS), set(shown) - set(SUMMARY_KEYS)
    # docs/quickstart.md lists the CSV's columns, the swept keys between `name` and `status`.
    text = (Path(__file__).parents[2] / "docs" / "quickstart.md").read_text()
    listed = text.split("`output/sweep.csv` has a header", 1)[1].split("\n- ", 1)[0]
    documented = re.findall(r"`([a-z_]+)`", re.sub(r"\([^)]*\)", "", listed))  # not (`ok`/`error`)
    assert documented == list(CSV_COLUMNS), documented
