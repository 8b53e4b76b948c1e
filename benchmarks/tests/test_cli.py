"""compress_benchmark.py as a user runs it: two spawned workers, a JSON result, clear errors."""
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def run(*flags, timeout=300):
    return subprocess.run([sys.executable, os.path.join(ROOT, "compress_benchmark.py"), *flags],
                          capture_output=True, text=True, timeout=timeout, cwd=ROOT)


def refusal(main, argv, capsys):
    """What a script says to bad flags, run in this process (a subprocess costs an interpreter
    and torch's import): argparse's message, or the ValueError that ``exit_with`` prints as
    one line.  The end-to-end path through ``exit_with`` is covered by :func:`error_line`."""
    try:
        main(argv)
    except SystemExit as exited:
        assert exited.code == 2, exited.code
        return capsys.readouterr().err
    except ValueError as error:
        return str(error)
    raise AssertionError(f"{argv} was accepted")


def test_two_workers_report_bytes_counted_at_the_backend(tmp_path):
    out = tmp_path / "result.json"
    done = run("--nproc", "2", "--compress", "--compressor", "topk", "--compress-ratio", "0.01",
               "--comm", "allgather", "--memory", "residual", "--fusion-num", "2", "--model", "resnet20",
               "--batch-size", "4", "--num-warmup-batches", "1", "--num-batches-per-iter", "1",
               "--num-iters", "2", "--threads", "1", "--json", str(out))
    assert done.returncode == 0, done.stderr[-2000:]
    assert "Iter #1:" in done.stdout and "Total img/sec on 2 workers:" in done.stdout
    assert ": 2 groups\n" in done.stdout
    # tqdm's multiprocessing lock, never released by a rank that skips teardown, used to
    # end every --nproc run with the resource tracker's warning
    assert "leaked semaphore" not in done.stderr, done.stderr
    result = json.loads(out.read_text())
    assert result["workers"] == 2 and result["groups"] == 2
    # top-k at 1% on the tight wire ("auto"'s choice at that density): an fp8 value and an
    # 8-bit offset, 2 bytes per kept element (k rounded down per group), a 1-byte count per
    # 255 elements of a group and a 4-byte scale per group, plus at most 8 bytes per part of
    # alignment padding in the allgather blob, plus the step's agreement: the preflight (two
    # float64) and the outcome (N + 2 float32)
    expected = 2 * 0.01 * result["num_params"] + result["num_params"] / 255
    counts = result["groups"] + 4 * result["groups"]  # each group's last block, its scale
    agreement = 16 + 4 * (2 + 2)
    assert 0.98 * expected + agreement <= result["bytes_per_step"] <= \
        expected + counts + 4 * 8 * result["groups"] + agreement


def test_op_profile_prints_the_operators_of_a_step():
    done = run("--nproc", "2", "--threads", "1", "--compress", "--compressor", "dgc", "--model", "resnet20",
               "--batch-size", "4", "--num-warmup-batches", "1", "--num-batches-per-iter", "1",
               "--num-iters", "1", "--op-profile", "2")
    assert done.returncode == 0, done.stderr[-2000:]
    assert "Operators over 2 step(s), by own CPU time per step" in done.stdout
    rows = [line for line in done.stdout.splitlines() if line.startswith("| aten::")]
    assert any(line.startswith("| aten::convolution_backward |") for line in rows), done.stdout
    assert done.stdout.count("Operators over") == 1  # rank 0 reports, every rank stepped
    # DGC's default warm-up runs under an Adam only: under the benchmark's SGD there is none
    # to lose, so nothing is said (the wrapper's once-per-job warning: tests/test_recipes.py)
    assert done.stderr.count("no epoch was set before its first step") == 0, done.stderr[-3000:]


def test_bad_flags_exit_with_a_clear_message(capsys):
    import compress_benchmark
    unknown = run("--compress", "--compressor", "topkk")  # once through the script, as a user runs it
    assert unknown.returncode == 2 and "did you mean 'topk'" in unknown.stderr
    main = compress_benchmark.main
    assert "--profile-in" in refusal(main, ["--scheduler", "optimal"], capsys)
    assert "--chunk-mb must be a size in MB > 0" in refusal(main, ["--scheduler", "auto", "--chunk-mb", "0"], capsys)
    assert "not 'fixed'" in refusal(main, ["--chunk-mb", "4"], capsys)
    profile = refusal(main, ["--op-profile", "-1"], capsys)
    assert "--op-profile must be ≥ 0" in profile and "got -1" in profile
    with pytest.raises(ValueError, match="available memories are"):
        compress_benchmark.main(["--compress", "--memory", "residul"])


def error_line(done):
    """The one line a bad configuration prints (no traceback), without the script's name."""
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and len(lines) == 1 and "Traceback" not in done.stderr, done.stderr
    prefix = "compress_benchmark.py: error: "
    assert lines[0].startswith(prefix), lines[0]
    return lines[0][len(prefix):]


def test_a_compressor_the_communicator_cannot_carry_is_refused_before_ranks_start():
    # The communicator's own construction check, run in the launching process: a rank's
    # error would start with "rank 0: ".
    message = error_line(run("--nproc", "2", "--compress", "--compressor", "topk", "--comm", "allreduce"))
    assert message.startswith("the allreduce communicator cannot carry compressor 'topk'")
    assert "Use communicator='allgather' or 'ps'" in message


def _bad_input_on_every_rank(args):
    raise ValueError(f"--num-iters {args.num_iters} is not what this rank expected")


def test_a_value_error_in_a_spawned_rank_comes_back_as_one_message():
    import argparse
    from benchmarks import harness
    with pytest.raises(ValueError) as raised:
        harness.run_workers(_bad_input_on_every_rank, argparse.Namespace(nproc=1, num_iters=3))
    assert str(raised.value) == "rank 0: --num-iters 3 is not what this rank expected"
    message = harness.value_error_message(
        'Traceback (most recent call last):\n  File "x.py", line 1, in <module>\n    f()\n'
        'ValueError: two\nlines\n')
    assert message == "two\nlines"
    chained = ('Traceback (most recent call last):\n  File "x.py", line 1, in f\nValueError: first\n\n'
               'During handling of the above exception, another exception occurred:\n\n'
               'Traceback (most recent call last):\n  File "x.py", line 3, in g\nKeyError: 1\n')
    assert harness.value_error_message(chained) is None  # a bug, not bad input: keep the traceback


def test_compression_flags_without_compress_are_refused(capsys):
    import compress_benchmark
    for flags, named in ((["--compressor", "topk", "--comm", "allgather"], "--compressor topk, --comm allgather"),
                         (["--compress-ratio", "0.01"], "--compress-ratio 0.01")):
        with pytest.raises(SystemExit) as exited:
            compress_benchmark.parse_args(flags)
        stderr = capsys.readouterr().err
        assert exited.value.code == 2 and f"{named} without --compress" in stderr and "add --compress" in stderr
    assert compress_benchmark.parse_args(["--compress", "--compressor", "topk"]).compress


def test_help_keeps_the_examples_lines_and_explains_every_flag():
    import compress_benchmark
    parser = compress_benchmark.build_parser()
    assert "--compress --compressor dgc \\\n        --comm allgather --memory dgc" in parser.format_help()
    assert [a.option_strings for a in parser._actions if not a.help] == []


def test_help_names_every_registered_communicator_and_memory():
    import compress_benchmark
    import mergecomp
    text = " ".join(compress_benchmark.build_parser().format_help().split())
    for name in mergecomp.communicators.available() + mergecomp.memories.available():
        assert name in text, name
    assert "hierarchical" in text and "sparse_allreduce" in text


def test_warmup_steps_reaches_the_sparsifiers_and_is_refused_elsewhere(capsys):
    import compress_benchmark
    from benchmarks.harness.flags import build_compressor
    for name in ("dgc", "topk", "graddrop"):
        args = compress_benchmark.parse_args(["--compress", "--compressor", name, "--warmup-steps", "30"])
        assert build_compressor(args).warmup_steps == 30, name
    main = compress_benchmark.main
    assert "compressor 'qsgd' has no density warm-up" in refusal(
        main, ["--compress", "--compressor", "qsgd", "--warmup-steps", "30"], capsys)
    assert "--warmup-steps 30 without --compress" in refusal(main, ["--warmup-steps", "30"], capsys)
    assert "warmup_steps must be a non-negative integer" in refusal(
        main, ["--compress", "--compressor", "dgc", "--warmup-steps", "-1"], capsys)


def test_plural_words_agree_with_their_numbers():
    from mergecomp.plan import Group, Plan
    text = Plan([Group(("w",))]).describe()
    assert ": 1 group\n" in text and "group 0: 1 tensor, send" in text
    assert ": 2 groups\n" in Plan([Group(("a", "b")), Group(("c",))]).describe()


def test_a_plan_file_that_is_not_a_plan_names_the_file_and_the_format(tmp_path):
    broken = tmp_path / "broken.json"
    broken.write_text('{"groups": [\n  {"names": ["fc.weight"]\n')
    message = error_line(run("--plan-in", str(broken)))
    assert f"plan file {broken}: " in message and "not JSON" in message and "line 3, column 1" in message
    assert 'a plan file is the JSON Plan.save (--plan-out) writes: {"groups": [{"names"' in message
    import compress_benchmark  # the same checks in this process (main raises, exit_with prints)
    listed = tmp_path / "list.json"
    listed.write_text("[1, 2]")
    with pytest.raises(ValueError, match=f'plan file {listed}: not a mergecomp plan: it has no list of "groups"'):
        compress_benchmark.main(["--plan-in", str(listed)])
    with pytest.raises(ValueError, match=f"cannot read plan file {tmp_path / 'missing.json'}: No such file"):
        compress_benchmark.main(["--plan-in", str(tmp_path / "missing.json")])
    other = tmp_path / "other.json"
    other.write_text('{"groups": [{"names": ["fc.weight"], "send": "compress"}]}')
    with pytest.raises(ValueError, match=f"--plan-in {other}: plan does not match the model") as raised:
        compress_benchmark.main(["--plan-in", str(other), "--model", "resnet20"])
    assert "from a run of --model resnet20" in str(raised.value)


def test_headline_pair_interleaves_windows_and_reports_a_ratio(tmp_path, capsys):
    out = tmp_path / "versus.json"
    done = subprocess.run(
        [sys.executable, os.path.join(ROOT, "benchmarks", "headline.py"), "pair", "--nproc", "2", "--threads", "1",
         "--model", "resnet20", "--batch-size", "4", "--num-warmup-batches", "1", "--compress",
         "--compressor", "dgc", "--compress-ratio", "0.01", "--fusion-num", "2", "--rounds", "2",
         "--window", "1", "--json", str(out)],
        capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(out.read_text())
    assert len(result["ratios"]) == 2 and result["ratio_median"] > 0 and result["groups"] == 2
    assert len(result["ddp_again_step_s"]) == 2 and result["ddp_versus_ddp_again"] > 0  # the noise control
    assert "DDP / DDP again: median" in done.stdout
    assert "SGD momentum 0.9" in done.stdout  # DDP applies the momentum the DGC memory applies
    from benchmarks import headline
    assert headline.main(["pair", "--table", str(out)]) in (0, None)
    assert "| resnet20 | dgc | optimizer | fixed | 2 (2) | 0 | fp16 |" in capsys.readouterr().out
    assert result["ddp_hook"] == "fp16"  # the 16-bit hook is the default baseline
    assert "--rounds must be ≥ 1, got 0" in refusal(headline.main, ["pair", "--rounds", "0"], capsys)


def test_headline_pair_runs_mergecomps_hook_beside_ddps_own(tmp_path, capsys):
    out = tmp_path / "hook.json"
    done = subprocess.run(
        [sys.executable, os.path.join(ROOT, "benchmarks", "headline.py"), "pair", "--nproc", "2", "--threads", "1",
         "--model", "resnet20", "--batch-size", "4", "--num-warmup-batches", "1", "--compress",
         "--compressor", "topk", "--fusion-num", "2", "--rounds", "1", "--window", "1",
         "--mergecomp-as", "ddp-hook", "--ddp-hook", "fp32", "--json", str(out)],
        capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(out.read_text())
    assert result["mergecomp_as"] == "ddp-hook" and result["ddp_hook"] == "fp32"
    assert 0 < result["mergecomp_bytes_per_step"] < 0.1 * 4 * 269722  # top-k 1%, far below FP32
    assert "DDP with mergecomp's hook" in done.stdout
    from benchmarks import headline
    adaptive = refusal(headline.main, ["pair", "--compress", "--compressor", "dgc", "--scheduler", "auto",
                                         "--mergecomp-as", "ddp-hook"], capsys)
    assert "DDP's fixed buckets" in adaptive


def test_headline_ddp_times_ddp_with_mergecomps_hook(tmp_path, capsys):
    out = tmp_path / "hook.json"
    done = subprocess.run(
        [sys.executable, os.path.join(ROOT, "benchmarks", "headline.py"), "ddp", "--nproc", "2", "--threads", "1",
         "--model", "resnet20", "--batch-size", "4", "--num-warmup-batches", "1", "--num-iters", "1",
         "--num-batches-per-iter", "1", "--hook", "mergecomp", "--compressor", "dgc", "--fusion-num", "2",
         "--json", str(out)], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(out.read_text())
    assert result["compressor"] == "ddp-mergecomp-dgc" and result["groups"] == 2
    # DGC's 3.5% on its tight wire (2 bytes a coordinate and 1 per block of 255: about 54×
    # fewer than fp32), plus its agreement bytes
    assert 40 < result["compression_ratio"] < 55
    from benchmarks import headline
    assert "--hook mergecomp needs --compressor" in refusal(headline.main, ["ddp", "--hook", "mergecomp"], capsys)


def test_scheduler_plans_compares_the_scheduler_with_fixed_and_saved_plans(tmp_path, capsys):
    saved, out = tmp_path / "two.json", tmp_path / "plans.json"
    common = ["--nproc", "2", "--threads", "1", "--model", "resnet20", "--batch-size", "4",
              "--num-warmup-batches", "1", "--compress", "--compressor", "efsignsgd"]
    done = run(*common, "--fusion-num", "2", "--num-iters", "1", "--num-batches-per-iter", "1",
               "--plan-out", str(saved))
    assert done.returncode == 0, done.stderr[-2000:]
    script = os.path.join(ROOT, "benchmarks", "scheduler.py")
    done = subprocess.run([sys.executable, script, *common, "--scheduler", "fixed", "--fusion-num", "1",
                           "--fusion-nums", "0,3", "--plans", str(saved), "--rounds", "2", "--window", "1",
                           "--json", str(out)], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(out.read_text())
    assert list(result["plans"]) == ["fixed", "fusion-num 0", "fusion-num 3", "two"]
    assert result["plans"]["fusion-num 3"]["groups"] == 3 and result["plans"]["two"]["groups"] == 2
    assert result["best_fixed"] in ("fusion-num 0", "fusion-num 3") and result["versus_best_fixed"] > 0
    assert all(len(p["step_s"]) == 2 for p in result["plans"].values())
    assert len(result["repeat"]["step_s"]) == 2 and result["repeat"]["versus"] > 0  # the noise control
    assert all(p["same_as"] is None for p in result["plans"].values())
    from benchmarks import scheduler
    capsys.readouterr()
    assert scheduler.main(["--table", str(out)]) in (0, None)
    assert "| resnet20 | efsignsgd | 1 (1) |" in capsys.readouterr().out
    assert "no such file" in refusal(scheduler.main, ["--plans", str(tmp_path / "nope.json")], capsys)
    repeat = tmp_path / "repeat.json"
    repeat.write_text(saved.read_text())
    for clash in ([str(saved), str(saved)], [str(repeat)]):
        taken = refusal(scheduler.main, ["--plans", *clash], capsys)
        assert "rename the file" in taken, taken


def test_compressor_benchmark_prints_a_row_per_compressor_and_dgc_against_topk():
    done = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "compressors.py"), "--sizes", "4096",
                           "--compressors", "dgc,signsgd", "--reps", "1", "--devices", "cpu"],
                          capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-2000:]
    rows = [line for line in done.stdout.splitlines() if line.startswith("| cpu | 4,096 |")]
    assert [row.split("|")[3].strip() for row in rows] == ["dgc", "signsgd"]
    assert "dgc selects" in rows[0] and "torch.topk" in rows[0]


def test_result_tables_name_a_file_that_is_not_a_result(tmp_path, capsys):
    from benchmarks import headline, scheduler
    plan = tmp_path / "saved.plan.json"
    plan.write_text('{"groups": []}')
    for mode in (["pair"], ["plans"], []):  # scheduler.py's plain form is its plans mode
        main = headline.main if mode == ["pair"] else scheduler.main
        for path, message in ((plan, "is not a result of"), (tmp_path / "missing.json", "cannot read")):
            said = refusal(main, [*mode, "--table", str(path)], capsys)
            assert message in said and str(path) in said, said


def test_interleaved_table_names_the_fixed_plan_that_is_the_schedulers_own(tmp_path):
    from benchmarks.scheduler import same_plans, table
    plans = {"auto": {"groups": 7, "compressed": 7, "digest": "aa", "step_s": [1.0], "median_s": 1.0},
             "fusion-num 2": {"groups": 2, "compressed": 2, "digest": "bb", "step_s": [1.1], "median_s": 1.1},
             "fusion-num 8": {"groups": 7, "compressed": 7, "digest": "aa", "step_s": [0.9], "median_s": 0.9}}
    result = {"model": "vgg16", "compressor": "dgc", "scheduler": "auto", "search_steps": 90, "plans": plans,
              "best_fixed": "fusion-num 8", "versus_best_fixed": 0.9,
              "versus": {"fusion-num 2": 1.1, "fusion-num 8": 0.9}}
    assert same_plans(result) == ["fusion-num 8"]
    path = tmp_path / "r.json"
    path.write_text(json.dumps(result))
    assert "| fusion-num 8 | 0.900 | fusion-num 8 (0.900) | – | – | – |" in table([str(path)])
    # Results with a repeat window ran the same plan once: the label alone, and the noise.
    plans["fusion-num 8"].update(step_s=[1.0], median_s=1.0, same_as="auto")
    result.update(best_fixed="fusion-num 8", versus_best_fixed=1.0, repeat={"step_s": [1.05], "median_s": 1.05,
                                                                            "versus": 1.05})
    path.write_text(json.dumps(result))
    assert "| fusion-num 8 | 1.000 | fusion-num 8 | 1.050 | – | – |" in table([str(path)])


def test_selection_floor_scores_a_selector_on_held_out_rounds():
    from benchmarks.scheduler import selection_floor

    def result(**times):
        return {"plans": {label.replace("fusion_num_", "fusion-num "): {"digest": label[-1] if label != "auto" else "8", "step_s": t}
                          for label, t in times.items()}}
    # A clearly faster plan is always found: the floor is 1.
    assert selection_floor(result(auto=[1.0] * 4, fusion_num_1=[2.0] * 4, fusion_num_8=[1.0] * 4)) == {
        "mean": 1.0, "misses": 0.0, "splits": 6}
    # Two plans that trade places: chosen on rounds 0, 1 (1.0 against 1.25) the first loses
    # on rounds 2, 3 (1.5): 0.833; the other way round 0.8; the four mixed splits tie
    # (1.25 each way) and score 1.
    floor = selection_floor(result(fusion_num_1=[1.0, 1.0, 1.5, 1.5], fusion_num_2=[1.25] * 4))
    assert floor["splits"] == 6 and floor["misses"] == pytest.approx(2 / 6)
    assert floor["mean"] == pytest.approx((1.25 / 1.5 + 1.0 / 1.25 + 4) / 6)
    # A fixed plan that repeats another (same digest) is one candidate; too few rounds: None.
    assert selection_floor(result(fusion_num_1=[1.0] * 4, fusion_num_11=[2.0] * 4)) is None
    assert selection_floor(result(fusion_num_1=[1.0] * 3, fusion_num_2=[2.0] * 3)) is None


def test_interleaved_plans_run_each_distinct_plan_once():
    from benchmarks.scheduler import distinct_plans
    from mergecomp.plan import Group, Plan
    seven, two = Plan([Group(("a", "b"), "compress")]), Plan([Group(("a",), "compress"), Group(("b",), "compress")])
    plans = {"auto": seven, "fusion-num 1": seven, "fusion-num 2": two, "fusion-num 3": two, "binary": seven}
    assert distinct_plans(plans) == {"fusion-num 1": "auto", "fusion-num 3": "fusion-num 2", "binary": "auto"}


def test_simulator_rounds_mode_predicts_each_plan_from_the_compute_of_its_round(tmp_path, capsys):
    out = tmp_path / "rounds.json"
    script = os.path.join(ROOT, "benchmarks", "simulator.py")
    done = subprocess.run([sys.executable, script, "rounds", "--nproc", "2", "--threads", "1", "--model", "resnet20",
                           "--batch-size", "4", "--num-warmup-batches", "1", "--compressor", "efsignsgd",
                           "--net-profile", "1gbit", "--link-efficiency", "0.9", "--plans", "auto,compress-2",
                           "--rounds", "2",
                           "--window", "1", "--json", str(out)], capture_output=True, text=True, timeout=300,
                          cwd=ROOT)
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(out.read_text())
    assert list(result["plans"]) == ["auto", "compress-2"] and result["workers"] == 2
    assert result["plans"]["compress-2"]["compressed"] == 2 and len(result["compute"]) == 2
    for row in result["plans"].values():
        assert len(row["measured_s"]) == len(row["predicted_s"]) == 2
        assert all(t > 0 for t in row["measured_s"] + row["predicted_s"]) and row["saved_profile_s"] > 0
        assert len(row["plan"]["groups"]) == row["groups"] and len(row["phases"]) == 2  # per rank
    from benchmarks import simulator
    capsys.readouterr()
    assert simulator.main(["rounds", "--table", str(out)]) in (0, None)
    assert "| 2 | compress-2 | 2 (2) |" in capsys.readouterr().out
    for flags, message in ((["--rounds", "0"], "--rounds must be ≥ 1, got 0"),
                           (["--plans", "fp32-x"], "neither 'auto' nor SEND-K"),
                           (["--net-profile", "loopback"], "is not rate-limited"),
                           (["--scheduler", "fixed"], "--scheduler must be auto"),
                           (["--link-efficiency", "2"], "a fraction in (0, 1]")):
        bad = refusal(simulator.main, ["rounds", "--net-profile", "1gbit", *flags], capsys)
        assert message in bad, bad


def test_compressors_sparse_sum_mode_prints_a_row_per_cell_and_refuses_dense_compressors(capsys):
    from benchmarks import compressors
    assert compressors.main(["sparse-sum", "--sizes", "10K", "--ranks", "2,3", "--reps", "1",
                             "--compressors", "dgc"]) in (0, None)
    out = capsys.readouterr().out
    assert [line.split("|")[3].strip() for line in out.splitlines() if line.startswith("| dgc |")] == ["2", "3"]
    assert "does not sum in place" in refusal(compressors.main, ["sparse-sum", "--compressors", "qsgd"], capsys)


def test_benchmark_tools_run_as_scripts_and_as_modules_and_name_an_unknown_mode(capsys):
    for argv in (["benchmarks/simulator.py", "rounds", "--help"], ["-m", "benchmarks.headline", "pair", "--help"]):
        done = subprocess.run([sys.executable, *argv], capture_output=True, text=True, timeout=120, cwd=ROOT)
        assert done.returncode == 0 and "usage:" in done.stdout, done.stderr[-2000:]
    from benchmarks import simulator
    said = refusal(simulator.main, ["rund"], capsys)
    assert "unknown mode 'rund'" in said and "check, rounds, phases" in said, said


def test_compressor_memory_benchmark_runs_on_a_models_real_gradient():
    done = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "compressors.py"), "memory",
                           "--gradients", "mlp", "--reps", "1"],
                          capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-2000:]
    rows = [line for line in done.stdout.splitlines() if line.startswith("| mlp | dgc | dgc |")]
    assert len(rows) >= 1, done.stdout
