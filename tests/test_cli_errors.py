"""Bad command-line input ends in one clear line on stderr and exit status 2, never a traceback,
and never after the work it would spoil (a model load, a simulation, a load test)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from training.cli import main


def usage_error(capsys, argv: list[str]) -> str:
    """The message of an argparse usage error (exit status 2) for `argv`."""
    with pytest.raises(SystemExit) as exited:
        main(argv)
    assert exited.value.code == 2, argv
    return capsys.readouterr().err


def test_a_missing_subcommand_is_named_by_its_choices(capsys) -> None:
    assert "required: {engine,serve,attention}" in usage_error(capsys, ["bench"])
    assert "required: {prepare}" in usage_error(capsys, ["data"])


def one_line_error(capsys, argv: list[str], command: str) -> str:
    """The message of an error found while `argv` ran: one line, exit status 2, no traceback."""
    assert main(argv) == 2, argv
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"lengthwise {command}: error: "), err
    return err[0]


@pytest.mark.parametrize("argv, flag", [
    (["generate", "hi", "--top-p", "0"], "--top-p"), (["generate", "hi", "--top-p", "7"], "--top-p"),
    (["generate", "hi", "--stop", ""], "--stop"), (["train", "--max-eval", "1"], "--max-eval"),
    (["train", "--max-train", "1"], "--max-train"),  # LightGBM's bagging of one row left none: a traceback
    (["bench", "engine", "--skip", "junk"], "--skip"), (["bench", "engine", "--block-size", "3"], "--block-size"),
    (["bench", "serve", "--goodput", "junk"], "--goodput"), (["bench", "serve", "--goodput", "ttft:abc"], "--goodput"),
    (["bench", "serve", "--goodput", "ttft:-5"], "--goodput"), (["bench", "serve", "--tier-mix", "junk"], "--tier-mix"),
    (["bench", "serve", "--goodput"], "--goodput"),  # no SLO at all: it ran and reported no goodput
    (["bench", "serve", "--tier-mix", "standard:x"], "--tier-mix"),
    (["simulate", "--tier-mix", "junk"], "--tier-mix"), (["simulate", "--tier-mix", "0,0,0"], "--tier-mix"),
    (["simulate", "--block-size", "3"], "--block-size"), (["bench", "attention", "--block-size", "24"], "--block-size"),
    (["serve", "--allowed-origins"], "--allowed-origins"), (["serve", "--allowed-origins", "localhost:3000"], "--allowed-origins"),
    (["serve", "--srpt-max-preempt-share", "1.5"], "--srpt-max-preempt-share"),
    (["simulate", "--batch-shed-share", "0"], "--batch-shed-share"),
    (["simulate", "--slo-e2e-standard", "nan"], "--slo-e2e-standard"),
    # A target of 0 s, which no request meets, was taken: admission refused that tier outright.
    (["serve", "--admission", "--slo-e2e-standard", "0"], "--slo-e2e-standard"),
    (["simulate", "--slo-ttft-interactive", "0"], "--slo-ttft-interactive"),
    # An empty path would mean the working folder: a run wrote mlflow.db there.
    (["train", "--store", ""], "--store"), (["eval-predictor", "--store", ""], "--store"),
    (["train", "--save", " "], "--save"), (["eval-predictor", "--json", ""], "--json"),
])
def test_values_that_can_be_checked_alone_are_usage_errors(capsys, argv, flag) -> None:
    err = usage_error(capsys, argv)
    assert f"argument {flag}" in err and "Traceback" not in err


def test_engine_start_up_errors_are_one_line(capsys, tiny_model_dir) -> None:
    model = ["--model", str(tiny_model_dir)]
    # serve binds its port before the engine is built: port 0, so a server on the default 8000
    # (`make serve` beside `make test`) does not turn these errors into "cannot listen there".
    serve = ["serve", *model, "--port", "0"]
    # Named by the flag, not the config field the engine checks ("kv_cache_memory_gib 1e-07 ...").
    assert "--kv-cache-memory 1e-07 holds no KV block" in one_line_error(
        capsys, ["generate", "hi", *model, "--kv-cache-memory", "1e-7"], "generate")
    assert "--max-num-batched-tokens (8) must be >= --max-num-seqs (16)" in one_line_error(
        capsys, [*serve, "--predictor", "none", "--max-num-batched-tokens", "8", "--max-num-seqs", "16"], "serve")
    assert "longer than the context" in one_line_error(
        capsys, ["generate", "hi", *model, "--max-model-len", "4"], "generate")
    assert "holds no KV block" in one_line_error(
        capsys, [*serve, "--predictor", "none", "--kv-cache-memory", "1e-7"], "serve")
    # vLLM's --swap-space; the field's name in an error is the flag's.
    assert "--swap-space 1e-09 holds no KV block" in one_line_error(
        capsys, [*serve, "--predictor", "none", "--preemption-mode", "swap", "--swap-space", "1e-9"], "serve")
    assert "--swap-space is used only with --preemption-mode swap" in one_line_error(
        capsys, [*serve, "--predictor", "none", "--swap-space", "1"], "serve")
    assert "exceeds the model's 2048 positions" in one_line_error(
        capsys, [*serve, "--predictor", "none", "--max-model-len", "20000"], "serve")
    assert "fewer than --max-model-len 1024" in one_line_error(
        capsys, [*serve, "--predictor", "none", "--max-model-len", "1024", "--kv-cache-memory", "0.0001"],
        "serve")
    assert "not a saved predictor folder" in one_line_error(
        capsys, [*serve, "--predictor", str(tiny_model_dir / "no-predictor")], "serve")


def test_files_that_are_not_what_a_flag_wants_are_one_line(capsys, tmp_path) -> None:
    not_json = tmp_path / "notes.md"
    not_json.write_text("# notes\n")
    out = ["--json", str(tmp_path / "sim.json"), "--no-plots"]
    assert "not a step-cost file" in one_line_error(
        capsys, ["simulate", "--step-cost", str(not_json), *out], "simulate")
    assert "not a parquet trace table" in one_line_error(capsys, ["trace", "--agreement", str(not_json)], "trace")
    assert "--resample " + str(not_json) + ": not a parquet trace table" in one_line_error(
        capsys, ["eval-predictor", "--predictor", "data/predictors/lexical", "--labels", "trace", "--resample",
                 str(not_json)], "eval-predictor")
    assert "needs --labels trace" in one_line_error(
        capsys, ["eval-predictor", "--predictor", "data/predictors/lexical", "--resample", str(not_json)],
        "eval-predictor")
    assert "is a file, not a folder" in one_line_error(
        capsys, ["eval-predictor", "--store", str(not_json)], "eval-predictor")
    unknown_kind = tmp_path / "predictor"
    unknown_kind.mkdir()
    (unknown_kind / "predictor.json").write_text('{"kind": "bogus"}')
    assert "not a predictor spec" in one_line_error(
        capsys, ["simulate", "--predictor", str(unknown_kind), *out], "simulate")


def test_a_workload_the_kv_budget_cannot_hold_is_one_line(capsys, tmp_path, monkeypatch) -> None:
    from scheduler.simulation import SimRequest
    from training import simulate

    workload = [SimRequest(request_id=f"r{i}", arrival_time=0.0, prompt_tokens=40, output_tokens=20,
                           predicted_len=20.0, max_tokens=None) for i in range(4)]
    monkeypatch.setattr(simulate, "build_base_workload", lambda args, turns: (workload, "test"))
    assert "cannot fit in 1 KV blocks" in one_line_error(
        capsys, ["simulate", "--kv-blocks", "1", "--json", str(tmp_path / "sim.json"), "--no-plots"], "simulate")


@pytest.mark.parametrize("command", [["generate", "hi"], ["serve", "--predictor", "none"],
                                     ["bench", "engine", "--skip", "hf_static,hf_continuous"]])
def test_a_missing_model_folder_is_named_with_the_fix(capsys, tmp_path, monkeypatch, command) -> None:
    # Before: transformers' "Repo id must use alphanumeric chars" traceback for a path, and for a
    # relative name like nosuch/model a wait of most of a minute on the hub when not offline.
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.chdir(tmp_path)
    name = " ".join(command[:2]) if command[0] == "bench" else command[0]
    for model in (str(tmp_path / "none"), "nosuch/model"):
        err = one_line_error(capsys, [*command, "--model", model, *(["--json", str(tmp_path / "b.json")]
                                                                     if name == "bench engine" else [])], name)
        assert f"no converted model at {model} (run `make model`)" in err


def test_the_triton_backend_is_refused_where_its_kernels_cannot_run(capsys, tmp_path, monkeypatch) -> None:
    import torch

    from engine.attention.backend import resolve_backend_name

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="needs a CUDA GPU"):
        resolve_backend_name("triton", torch.device("cpu"))
    assert resolve_backend_name("auto", torch.device("cpu")) == "torch"
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # the interpreter runs the kernels on the CPU
    assert resolve_backend_name("triton", torch.device("cpu")) == "triton"
    # ... except bfloat16 arithmetic, which it gets wrong: auto takes the reference, triton is refused.
    assert resolve_backend_name("auto", torch.device("cpu"), torch.bfloat16) == "torch"
    with pytest.raises(ValueError, match="computes bfloat16 wrongly"):
        resolve_backend_name("triton", torch.device("cpu"), torch.bfloat16)
    assert resolve_backend_name("auto", torch.device("cpu"), torch.float16) == "triton"


def test_a_bfloat16_engine_under_the_interpreter_never_runs_the_triton_kernels(tiny_model_dir, monkeypatch) -> None:
    import torch

    from engine import llm_engine
    from engine.attention.backend import TorchReferenceBackend
    from engine.config import EngineConfig

    if torch.cuda.is_available():
        pytest.skip("CUDA is available: the kernels are compiled, not interpreted")
    monkeypatch.setenv("TRITON_INTERPRET", "1")

    def config(backend: str) -> EngineConfig:
        return EngineConfig(model=str(tiny_model_dir), dtype="bfloat16", device="cpu", attention_backend=backend,
                            num_gpu_blocks=16, max_model_len=256, num_threads=1)

    assert isinstance(llm_engine.LLMEngine(config("auto")).runner.backend, TorchReferenceBackend)
    monkeypatch.setattr(llm_engine, "load_model", lambda *a, **k: pytest.fail("weights loaded before the check"))
    with pytest.raises(ValueError, match="computes bfloat16 wrongly"):
        llm_engine.LLMEngine(config("triton"))


def test_generate_refuses_triton_without_cuda_before_loading(capsys, tiny_model_dir, monkeypatch) -> None:
    import torch

    from engine import llm_engine

    if torch.cuda.is_available():
        pytest.skip("CUDA is available: the triton backend runs here")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(llm_engine, "load_model", lambda *a, **k: pytest.fail("weights loaded before the check"))
    monkeypatch.setattr(llm_engine, "load_tokenizer", lambda *a, **k: pytest.fail("tokenizer loaded before the check"))
    monkeypatch.setattr(llm_engine, "KVCache", lambda *a, **k: pytest.fail("KV cache allocated before the check"))
    err = one_line_error(capsys, ["generate", "hi", "--model", str(tiny_model_dir), "--attention-backend", "triton"],
                         "generate")
    assert "needs a CUDA GPU (or TRITON_INTERPRET=1)" in err


def test_generate_refuses_an_empty_raw_prompt_before_loading(capsys, tiny_model_dir, monkeypatch) -> None:
    from engine import llm

    monkeypatch.setattr(llm, "LLM", lambda *args, **kwargs: pytest.fail("loaded before the prompts were checked"))
    err = one_line_error(capsys, ["generate", "hi", "", "--raw", "--model", str(tiny_model_dir)], "generate")
    assert "--raw: a prompt must not be empty" in err
    # Bytes that are not UTF-8 reach argv as lone surrogates: a TypeError traceback from the tokenizer.
    for raw in ([], ["--raw"]):
        err = one_line_error(capsys, ["generate", "hi", "bad \udcff", *raw, "--model", str(tiny_model_dir)], "generate")
        assert "prompt 2 is not valid UTF-8 text" in err


def test_default_paths_do_not_depend_on_the_working_directory(tmp_path, monkeypatch) -> None:
    from pathlib import Path

    from engine.config import EngineConfig
    from training import simulate
    from training.cli import _build_parser

    root = Path(__file__).resolve().parents[1]
    monkeypatch.chdir(tmp_path)
    from training.bench_engine import DEFAULT_STEP_COST_OUT

    defaults = [EngineConfig().model, simulate.DEFAULT_STEP_COST, DEFAULT_STEP_COST_OUT]
    for argv, names in ((["generate", "hi"], ("model",)),
                        (["bench", "engine"], ("model", "json")), (["bench", "serve"], ("result_dir",)),
                        (["simulate"], ("predictor", "json"))):
        args = _build_parser(argv).parse_args(argv)
        defaults += [getattr(args, name) for name in names]
    from engine.server.serve_cli import model_folder

    defaults.append(model_folder(_build_parser(["serve"]).parse_args(["serve"])))
    for path in defaults:
        assert Path(path).is_absolute() and Path(path).is_relative_to(root), path


def test_calibrating_does_not_overwrite_the_committed_step_cost_by_default() -> None:
    from engine.config import REPO_ROOT
    from training import simulate
    from training.cli import _build_parser

    from training.bench_engine import step_cost_path

    args = _build_parser(["bench", "engine"]).parse_args(["bench", "engine", "--calibrate"])
    assert step_cost_path(args) == REPO_ROOT / "out" / "step_cost.json"
    assert simulate.DEFAULT_STEP_COST == REPO_ROOT / "data" / "step_cost.json"


@pytest.fixture
def taken(tmp_path):
    """A folder and a file where an output path wants the other."""
    folder, a_file = tmp_path / "taken", tmp_path / "file.txt"
    folder.mkdir()
    a_file.write_text("x")
    return folder, a_file


# Each command below would have run (a load test, a model load, a simulation, a training) and
# only then lost its results to the bad output path.
def test_bench_serve_checks_its_result_dir_before_the_load(capsys, taken, monkeypatch) -> None:
    from training import bench_serve

    monkeypatch.setattr(bench_serve, "server_model", lambda args: "m")  # a server that answers
    monkeypatch.setattr(bench_serve, "run_load", lambda *args: pytest.fail("load started first"))
    small = ["--num-prompts", "2", "--no-mlflow"]
    # /proc takes no new file, even from root, whose permission bits say it could.
    assert "--result-dir /proc/nope: not writable" in one_line_error(
        capsys, ["bench", "serve", "--result-dir", "/proc/nope", *small], "bench serve")
    assert f"{taken[1]} is a file, not a folder" in one_line_error(
        capsys, ["bench", "serve", "--result-dir", str(taken[1] / "sub"), *small], "bench serve")


def test_bench_serve_needs_a_server_before_it_writes_anything(capsys, tmp_path) -> None:
    # With --model given it used to skip the server, send every request, fail them all (exit 1)
    # and still write a result; a URL without a scheme was a traceback.
    import socket

    with socket.socket() as probe:  # a port nothing listens on
        probe.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{probe.getsockname()[1]}"
    out = tmp_path / "new" / "results"
    for base_url in (url, url.removeprefix("http://")):
        err = one_line_error(capsys, ["bench", "serve", "--base-url", base_url, "--model", "m", "--num-prompts", "2",
                                      "--result-dir", str(out), "--no-mlflow"], "bench serve")
        assert f"--base-url {base_url}: cannot list its models" in err
    assert not (tmp_path / "new").exists()


def test_bench_serve_names_runs_that_become_file_names(capsys) -> None:
    assert "argument --label: a run name becomes a file name" in usage_error(
        capsys, ["bench", "serve", "--label", "fcfs/run1"])
    assert "argument --api-key: an API key must not be empty" in usage_error(
        capsys, ["bench", "serve", "--api-key", ""])


def test_bench_serve_checks_its_baseline_before_the_load(capsys, tmp_path, monkeypatch) -> None:
    from training import bench_serve

    monkeypatch.setattr(bench_serve, "server_model", lambda args: pytest.fail("load started first"))
    out = ["--result-dir", str(tmp_path / "out"), "--no-mlflow"]
    missing = tmp_path / "fcfs.json"
    assert f"--baseline {missing}: not a readable bench serve JSON" in one_line_error(
        capsys, ["bench", "serve", *out, "--baseline", str(missing)], "bench serve")
    missing.write_text('{"completed": 3}')
    assert "not a bench serve result (no config or requests)" in one_line_error(
        capsys, ["bench", "serve", *out, "--baseline", str(missing)], "bench serve")


def test_bench_serve_refuses_to_write_its_result_over_its_baseline(capsys, tmp_path, monkeypatch) -> None:
    # The label defaults to policy-rate, the baseline's own name when the two runs share a policy
    # and a folder: the comparison file was replaced without a word.
    from training import bench_serve, bench_serve_compare

    monkeypatch.setattr(bench_serve_compare, "load_baseline", lambda path: {})
    monkeypatch.setattr(bench_serve, "server_model", lambda args: "m")
    monkeypatch.setattr(bench_serve, "sample_workload", lambda args: [])
    monkeypatch.setattr(bench_serve, "server_state", lambda base_url: ({"policy": "fcfs"}, None))
    monkeypatch.setattr(bench_serve, "run_load", lambda *args: pytest.fail("the load ran"))
    out = tmp_path / "results"
    baseline = out / "fcfs-rate4.json"
    assert "this run writes its result there (fcfs-rate4.json in --result-dir)" in one_line_error(
        capsys, ["bench", "serve", "--request-rate", "4", "--result-dir", str(out), "--no-mlflow",
                 "--baseline", str(baseline)], "bench serve")


def test_simulate_refuses_an_arrival_cv_without_gamma_arrivals(capsys) -> None:
    # Poisson arrivals ran and the CV did nothing.
    assert "--arrival-cv: only --arrival gamma reads it (--arrival poisson)" in one_line_error(
        capsys, ["simulate", "--arrival-cv", "3"], "simulate")


def test_simulate_refuses_a_knob_none_of_its_policies_reads(capsys) -> None:
    # Serve refused it; simulate ran and the knob did nothing.
    assert "--srpt-max-preempt-share: --policies fcfs,sjf do not read it" in one_line_error(
        capsys, ["simulate", "--policies", "fcfs,sjf", "--srpt-max-preempt-share", "0.3"], "simulate")


def test_bench_engine_checks_its_outputs_before_the_runs(capsys, tmp_path, taken, tiny_model_dir,
                                                        monkeypatch) -> None:
    from training import bench_engine

    monkeypatch.setattr(bench_engine, "run_engine", lambda *args: pytest.fail("ran before the outputs were checked"))
    model = ["--model", str(tiny_model_dir), "--num-prompts", "2"]
    assert f"--json {taken[0]}: is a folder" in one_line_error(
        capsys, ["bench", "engine", *model, "--json", str(taken[0])], "bench engine")
    assert "--step-cost-out /proc/nope/cost.json: not writable" in one_line_error(
        capsys, ["bench", "engine", *model, "--json", str(tmp_path / "b.json"), "--calibrate",
                 "--step-cost-out", "/proc/nope/cost.json"], "bench engine")
    # Without --calibrate nothing is fitted, so the file asked for would never be written.
    assert "--step-cost-out is written only with --calibrate" in one_line_error(
        capsys, ["bench", "engine", *model, "--json", str(tmp_path / "b.json"), "--step-cost-out",
                 str(tmp_path / "cost.json")], "bench engine")
    same = str(tmp_path / "b.json")
    assert "the same file as --json" in one_line_error(
        capsys, ["bench", "engine", *model, "--json", same, "--calibrate", "--step-cost-out", same], "bench engine")
    # The plot is the .png beside --json: it overwrote a --json X.png, or a step cost written there.
    assert "the plot is written to the .png beside it" in one_line_error(
        capsys, ["bench", "engine", *model, "--json", str(tmp_path / "b.png")], "bench engine")
    assert "the same file as --json or its plot" in one_line_error(
        capsys, ["bench", "engine", *model, "--json", same, "--calibrate", "--step-cost-out",
                 str(tmp_path / "b.png")], "bench engine")
    # Input that is wrong is named before any output folder is made.
    assert "no first turn of the test split fits" in one_line_error(
        capsys, ["bench", "engine", *model, "--max-prompt-tokens", "1", "--json", str(tmp_path / "new" / "b.json")],
        "bench engine")
    assert not (tmp_path / "new").exists()


def test_simulate_and_trace_check_their_outputs_first(capsys, tmp_path, taken, tiny_model_dir, monkeypatch) -> None:
    from training import simulate

    monkeypatch.setattr(simulate, "build_base_workload", lambda *args: pytest.fail("predicted before --json"))
    assert f"--json {taken[0]}: is a folder" in one_line_error(
        capsys, ["simulate", "--json", str(taken[0]), "--num-requests", "2"], "simulate")
    assert f"--out {taken[0]}: is a folder" in one_line_error(
        capsys, ["trace", "--num-prompts", "1", "--log", str(tmp_path / "t.jsonl"), "--out", str(taken[0]),
                 "--model", str(tiny_model_dir)], "trace")


def test_a_bad_input_leaves_no_output_behind(capsys, tmp_path) -> None:
    new = tmp_path / "new"
    # simulate: a folder that is no predictor, and a prompt bound no turn fits (an IndexError once)
    assert "not a saved predictor folder" in one_line_error(
        capsys, ["simulate", "--predictor", str(tmp_path), "--json", str(new / "s.json")], "simulate")
    spec = Path("data/predictors/default/predictor.json")  # it said ".../predictor.json/predictor.json not found"
    assert f"{spec} is a file: a saved predictor is a folder" in one_line_error(
        capsys, ["simulate", "--predictor", str(spec), "--json", str(new / "s.json")], "simulate")
    assert "--max-prompt-tokens 1: no test turn fits" in one_line_error(
        capsys, ["simulate", "--max-prompt-tokens", "1", "--predictions", "noisy-oracle", "--num-requests", "2",
                 "--json", str(new / "s.json")], "simulate")
    assert "not a saved predictor folder" in one_line_error(
        capsys, ["eval-predictor", "--predictor", str(tmp_path / "none"), "--json", str(new / "e.json")],
        "eval-predictor")
    # train: the store is checked, not made, before the arguments are (--prior needs embed_lgbm)
    assert "--prior applies to --model embed_lgbm --labels trace only" in one_line_error(
        capsys, ["train", "--model", "length", "--prior", str(tmp_path), "--store", str(new / "store")], "train")
    # trace: a missing model is found before its log is seeded from the committed table
    assert "no converted model" in one_line_error(
        capsys, ["trace", "--num-prompts", "1", "--model", str(tmp_path / "none"), "--log", str(new / "t.jsonl"),
                 "--out", str(new / "t.parquet")], "trace")
    assert not new.exists()


def test_trace_refuses_a_reply_budget_that_leaves_no_room_for_a_prompt(capsys, tmp_path, tiny_model_dir) -> None:
    # It traced nothing and exited 0 ("traced 0 new prompts").
    assert "--max-tokens 5000: leaves no room for a prompt in the 2048-token context" in one_line_error(
        capsys, ["trace", "--num-prompts", "1", "--max-tokens", "5000", "--model", str(tiny_model_dir),
                 "--log", str(tmp_path / "t.jsonl"), "--out", str(tmp_path / "t.parquet")], "trace")
    assert not (tmp_path / "t.jsonl").exists()


def test_trace_refuses_a_prompt_budget_no_prompt_fits_before_loading(capsys, tmp_path, tiny_model_dir,
                                                                     monkeypatch) -> None:
    # It traced nothing, exited 0 and wrote a table of no rows, which the next run refused.
    import engine.llm

    monkeypatch.setattr(engine.llm, "LLM", lambda **kwargs: pytest.fail("the model loaded"))
    assert "--max-prompt-tokens 5: no prompt fits" in one_line_error(
        capsys, ["trace", "--num-prompts", "1", "--max-prompt-tokens", "5", "--model", str(tiny_model_dir),
                 "--log", str(tmp_path / "t.jsonl"), "--out", str(tmp_path / "t.parquet")], "trace")
    assert not (tmp_path / "t.parquet").exists() and not (tmp_path / "t.jsonl").exists()


def test_trace_says_which_damaged_log_lines_it_skipped(capsys, tmp_path, tiny_model_dir, monkeypatch) -> None:
    # They were skipped without a word, and their prompts traced again.
    import engine.llm

    monkeypatch.setattr(engine.llm, "LLM", lambda **kwargs: pytest.fail("the model loaded"))
    record = {"key": "k", "conversation_id": "c", "turn_index": 0, "prompt": "p", "prompt_tokens": 1,
              "output_tokens": 3, "finish_reason": "stop", "split": "test", "in_train": False}
    log = tmp_path / "t.jsonl"
    log.write_text(json.dumps(record) + "\n{oops\n" + json.dumps(record) + "\n")
    assert main(["trace", "--num-prompts", "1", "--max-prompt-tokens", "5", "--model", str(tiny_model_dir),
                 "--log", str(log), "--out", str(tmp_path / "t.parquet")]) == 2
    err = capsys.readouterr().err.splitlines()
    assert err[0] == f"--log {log}: skipped unreadable line(s) 2; their prompts are traced again"
    assert "no prompt fits" in err[1]


def test_trace_and_train_argument_errors_are_exit_status_2(capsys, tmp_path) -> None:
    # They were SystemExit messages: exit status 1 and no "lengthwise trace: error:" prefix.
    assert "--num-prompts is required" in one_line_error(capsys, ["trace"], "trace")
    assert "--resample-split needs its own --log and --out" in one_line_error(
        capsys, ["trace", "--num-prompts", "1", "--resample-split", "test"], "trace")
    assert "--hold-out-trace applies to --labels sharegpt only" in one_line_error(
        capsys, ["train", "--model", "length", "--labels", "trace", "--hold-out-trace",
                 "--store", str(tmp_path / "store")], "train")
    assert "exists and is not a predictor folder" in one_line_error(
        capsys, ["train", "--model", "length", "--save", "README.md", "--store", str(tmp_path / "store")], "train")


def test_data_prepare_checks_its_outputs_before_parsing(capsys, tmp_path, monkeypatch) -> None:
    from training import data_prepare, dataset

    monkeypatch.setattr(data_prepare, "prepare", lambda *args: pytest.fail("parsed before the outputs were checked"))
    assert "--card-dir /proc/x: not writable" in one_line_error(
        capsys, ["data", "prepare", "--out", str(tmp_path / "t"), "--card-dir", "/proc/x"], "data prepare")
    assert not (tmp_path / "t").exists()  # --out is made only once both places were checked
    # An empty path (an unset shell variable) meant the working folder, whose README.md the card
    # replaced up to its second section: refused, and so is any README.md that is no data card.
    for flag in ("--out", "--card-dir"):
        with pytest.raises(SystemExit):
            main(["data", "prepare", flag, ""])
        assert "give a path" in capsys.readouterr().err
    project = tmp_path / "project"
    project.mkdir()
    (project / "README.md").write_text("# My project\n\nIntro.\n\n## Install\n")
    assert "is not a data card" in one_line_error(
        capsys, ["data", "prepare", "--out", str(project), "--limit", "5"], "data prepare")
    assert (project / "README.md").read_text().startswith("# My project")
    # A table written elsewhere keeps its card in its own folder: not over the committed
    # data/README.md, nor over a README.md above it (the repository's, for --out turns).
    seen = {}
    monkeypatch.setattr(data_prepare, "prepare", lambda out, card_dir, limit: seen.update(card=card_dir) or {})
    assert main(["data", "prepare", "--out", str(tmp_path / "t"), "--limit", "5"]) == 0
    assert seen["card"] == tmp_path / "t"
    assert data_prepare.default_card_dir(dataset.DEFAULT_TABLE_DIR) == dataset.REPO_ROOT / "data"


def test_eval_predictor_checks_its_json_before_evaluating(capsys, taken, monkeypatch) -> None:
    from training import evaluate

    monkeypatch.setattr(evaluate, "evaluate", lambda *args: pytest.fail("evaluated before --json was checked"))
    assert f"--json {taken[0]}: is a folder" in one_line_error(
        capsys, ["eval-predictor", "--predictor", "data/predictors/default", "--json", str(taken[0])],
        "eval-predictor")


def test_train_checks_its_store_before_training(capsys, taken, monkeypatch) -> None:
    from training import train

    monkeypatch.setattr(train, "run", lambda args: pytest.fail("trained before the store was checked"))
    assert "is a file, not a folder" in one_line_error(
        capsys, ["train", "--model", "length", "--store", str(taken[1])], "train")
    assert "--store /proc/nope: not writable" in one_line_error(
        capsys, ["train", "--model", "length", "--store", "/proc/nope"], "train")


def test_train_refuses_a_store_whose_database_is_no_mlflow_store_before_training(capsys, tmp_path,
                                                                                 monkeypatch) -> None:
    # It trained in full, replaced --save, and then died in a database error's traceback. The
    # default store (no --store) was not checked up front at all.
    from training import tracking, train

    monkeypatch.setattr(train, "run", lambda args: pytest.fail("trained before the store was checked"))
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "mlflow.db").write_text("not a database")
    assert f"--store {broken}: its mlflow.db is not an MLflow store" in one_line_error(
        capsys, ["train", "--model", "length", "--store", str(broken)], "train")
    monkeypatch.setattr(tracking, "default_store", lambda: broken)
    assert f"the MLflow store {broken}: its mlflow.db" in one_line_error(capsys, ["train", "--model", "length"],
                                                                        "train")
    folder = tmp_path / "folder"
    (folder / "mlflow.db").mkdir(parents=True)  # a folder in the database's place
    assert "its mlflow.db is not an MLflow store" in one_line_error(
        capsys, ["train", "--model", "length", "--store", str(folder)], "train")


def test_eval_predictor_refuses_a_store_it_would_ignore(capsys, tmp_path) -> None:
    # With a predictor folder --store was silently ignored: "the champion of X" evaluated PATH.
    assert "--store names where 'champion' is looked up" in one_line_error(
        capsys, ["eval-predictor", "--predictor", "data/predictors/lexical", "--store", str(tmp_path),
                 "--no-latency"], "eval-predictor")


def test_eval_predictor_reads_its_store_without_creating_it(capsys, tmp_path) -> None:
    typo = tmp_path / "typo"
    assert f"no MLflow store at {typo}" in one_line_error(
        capsys, ["eval-predictor", "--store", str(typo), "--no-latency"], "eval-predictor")
    assert not typo.exists()
    # Nor asks that it could be written: a store in a place it may not write is still only read.
    assert "no MLflow store at /proc/nope" in one_line_error(
        capsys, ["eval-predictor", "--store", "/proc/nope", "--no-latency"], "eval-predictor")


@pytest.mark.parametrize("policies, message", [(",", "no policies"), ("", "no policies"),
                                               ("fcfs,bogus", "unknown policies bogus")])
def test_simulate_needs_known_policies(capsys, tmp_path, policies, message) -> None:
    # "," ran no policy, exited 0 and wrote an empty report.
    err = usage_error(capsys, ["simulate", "--policies", policies, "--json", str(tmp_path / "sim.json"),
                               "--num-requests", "2", "--predictions", "noisy-oracle", "--no-plots"])
    assert f"argument --policies: {message}" in err and not (tmp_path / "sim.json").exists()


def test_a_stray_argument_is_reported_with_the_commands_usage(capsys) -> None:
    err = usage_error(capsys, ["serve", "--uvicorn-log-lvl=debug"])
    assert "usage: lengthwise serve" in err and err.strip().splitlines()[-1] == (
        "lengthwise serve: error: unrecognized arguments: --uvicorn-log-lvl=debug")
    err = usage_error(capsys, ["bench", "serve", "--num-promptz", "3"]).strip().splitlines()[-1]
    assert err == "lengthwise bench serve: error: unrecognized arguments: --num-promptz 3"


def test_serve_takes_the_model_as_vllm_serve_does_and_refuses_two_different_ones(capsys, tmp_path) -> None:
    from engine.server.serve_cli import model_folder
    from training.cli import _build_parser

    def parsed(*argv):
        return _build_parser(["serve"]).parse_args(["serve", *argv])

    assert model_folder(parsed("m")) == "m" == model_folder(parsed("--model", "m")) == model_folder(parsed("m", "--model", "m"))
    assert model_folder(parsed("m/", "--model", "./m")) == "m/"  # one folder, spelled two ways
    err = one_line_error(capsys, ["serve", str(tmp_path / "a"), "--model", str(tmp_path / "b"), "--port", "0"], "serve")
    assert "the model is named twice" in err


def test_the_api_key_comes_from_the_environment_when_not_given(monkeypatch) -> None:
    from engine.arg_types import API_KEY_VARIABLES, api_key_or_environment

    for variable in API_KEY_VARIABLES:
        monkeypatch.delenv(variable, raising=False)
    assert api_key_or_environment(None) is None
    monkeypatch.setenv("VLLM_API_KEY", "from-vllm")
    assert api_key_or_environment(None) == "from-vllm"
    monkeypatch.setenv("LENGTHWISE_API_KEY", "ours")
    assert api_key_or_environment(None) == "ours" and api_key_or_environment("given") == "given"
    monkeypatch.setenv("LENGTHWISE_API_KEY", " ")
    with pytest.raises(ValueError, match=r"\$LENGTHWISE_API_KEY is set but empty"):
        api_key_or_environment(None)


def test_an_empty_api_key_variable_stops_serve_and_bench_serve_before_any_work(capsys, monkeypatch) -> None:
    from engine import llm_engine
    from training import bench_serve

    monkeypatch.setenv("LENGTHWISE_API_KEY", "")
    monkeypatch.setattr(llm_engine, "check_model_dir", lambda model: pytest.fail("model read first"))
    monkeypatch.setattr(bench_serve, "server_model", lambda args: pytest.fail("server asked first"))
    for argv, command in ((["serve", "--port", "0"], "serve"), (["bench", "serve", "--no-mlflow"], "bench serve")):
        assert "$LENGTHWISE_API_KEY is set but empty" in one_line_error(capsys, argv, command)


def test_usage_errors_name_the_flag_once(capsys) -> None:
    err = usage_error(capsys, ["bench", "serve", "--goodput", "ttft:abc"]).splitlines()[-1]
    assert err.count("--goodput") == 1 and "an SLO is KEY:MS" in err
    err = usage_error(capsys, ["bench", "serve", "--tier-mix", "gold:1"]).splitlines()[-1]
    assert err.count("--tier-mix") == 1 and "a tier mix is TIER:SHARE" in err


def test_an_origin_is_kept_as_browsers_send_it() -> None:
    from engine.arg_types import cors_origin

    assert cors_origin("http://localhost:3000/") == "http://localhost:3000"  # never matched with the slash
    assert (cors_origin("*"), cors_origin("https://ui.example")) == ("*", "https://ui.example")


def test_serving_one_model_with_a_probe_of_another_is_said(caplog, tmp_path) -> None:
    from types import SimpleNamespace

    from engine.server.serve_cli import warn_if_probing_another_model

    probe = SimpleNamespace(probed_model_dir=tmp_path / "smollm2")
    with caplog.at_level("WARNING", logger="lengthwise.serve"):
        warn_if_probing_another_model(probe, str(tmp_path / "smollm2"))
        warn_if_probing_another_model(SimpleNamespace(), str(tmp_path / "other"))  # not a probe
        assert not caplog.records
        warn_if_probing_another_model(probe, str(tmp_path / "other"))
    assert len(caplog.records) == 1 and "not the served model" in caplog.records[0].getMessage()


def test_every_command_runs_offline_unless_told_otherwise(capsys, monkeypatch, tmp_path) -> None:
    # The Makefile sets these, but `lengthwise` run by hand must not reach the hub either.
    for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_DATASETS_OFFLINE"):
        monkeypatch.delenv(name, raising=False)
    assert main(["trace", "--agreement", str(tmp_path / "missing.parquet")]) == 2
    import os

    assert all(os.environ[name] == "1" for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_DATASETS_OFFLINE"))


@pytest.mark.filterwarnings("ignore:One or more sample arguments is too small")  # the point of the test
def test_eval_predictor_writes_null_not_nan_for_a_metric_a_tiny_subset_leaves_undefined(capsys, tmp_path) -> None:
    out = tmp_path / "eval.json"
    assert main(["eval-predictor", "--predictor", "data/predictors/lexical", "--limit", "2", "--no-latency",
                 "--json", str(out)]) == 0
    capsys.readouterr()

    def refuse(constant):
        raise AssertionError(f"{constant} is not JSON")

    report = json.loads(out.read_text(), parse_constant=refuse)
    assert report["num_examples"] == 2 and None in report.values()


def test_serve_finds_a_taken_port_before_loading_the_model(capsys, tiny_model_dir, monkeypatch) -> None:
    # It loaded the model, then uvicorn logged ten lines and exited 3.
    import socket

    from engine.server import serve_cli

    monkeypatch.setattr(serve_cli, "build_server", lambda *args: pytest.fail("loaded before binding"))
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        assert f"--host 127.0.0.1 --port {port}: cannot listen there" in one_line_error(
            capsys, ["serve", "--model", str(tiny_model_dir), "--predictor", "none", "--port", str(port)], "serve")
    # An empty key would refuse every request, since clients send none.
    assert "argument --api-key: an API key must not be empty" in usage_error(capsys, ["serve", "--api-key", ""])

    def no_such_host(*args, **kwargs):
        raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")

    monkeypatch.setattr(socket, "getaddrinfo", no_such_host)
    assert "--host nowhere: cannot listen there (Name or service not known)" in one_line_error(
        capsys, ["serve", "--model", str(tiny_model_dir), "--predictor", "none", "--host", "nowhere"], "serve")


def test_serve_listens_before_handing_its_sockets_to_uvicorn() -> None:
    import socket

    from engine.server.serve_cli import listen_sockets, url_host

    first = listen_sockets("127.0.0.1", 0)
    try:
        port = first[0].getsockname()[1]
        with socket.create_connection(("127.0.0.1", port), timeout=5):
            pass  # accepted into the backlog: listening, not only bound
        with pytest.raises(OSError, match=f"--port {port}: cannot listen there"):
            listen_sockets("127.0.0.1", port)  # both bound with SO_REUSEADDR: only listen() tells
    finally:
        for sock in first:
            sock.close()
    assert url_host("::1") == "[::1]" and url_host("127.0.0.1") == "127.0.0.1"


def test_port_0_on_every_interface_is_one_port_for_every_address() -> None:
    from engine.server.serve_cli import listen_sockets

    try:
        sockets = listen_sockets("", 0)
    except OSError as exc:  # a host without IPv6 may refuse the "::" half
        pytest.skip(f"cannot listen on every interface here: {exc}")
    try:
        ports = {sock.getsockname()[1] for sock in sockets}
        assert len(ports) == 1, [sock.getsockname() for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


@pytest.mark.skipif(not Path("/proc/meminfo").exists(), reason="the check reads MemAvailable from /proc/meminfo")
def test_a_kv_cache_larger_than_memory_is_one_line(capsys, tiny_model_dir) -> None:
    # It was a 23-line allocator traceback.
    err = one_line_error(capsys, ["generate", "hi", "--model", str(tiny_model_dir), "--kv-cache-memory", "100000"],
                         "generate")
    # generate has no swap pool, and names the flag it has: a field it had no flag for sent users looking.
    assert "of host memory (--kv-cache-memory on a CPU)" in err and "swap" not in err


def test_an_output_location_is_checked_by_writing_and_nothing_is_made(tmp_path) -> None:
    from engine.arg_types import check_output_location, prepare_output_file

    with pytest.raises(PermissionError, match="--json /proc/x.json: not writable"):
        prepare_output_file("/proc/x.json", "--json")  # root's permission bits say it could
    check_output_location(tmp_path / "a" / "b" / "c.json", "--json", folder=False)
    check_output_location(tmp_path / "d", "--out", folder=True)
    assert list(tmp_path.iterdir()) == []  # no folder, no probe file left
    kept = tmp_path / "kept.json"
    kept.write_text("old")
    check_output_location(kept, "--json", folder=False)
    assert kept.read_text() == "old"


@pytest.mark.parametrize("knob", [["--max-queued-tokens", "100"], ["--batch-shed-share", "0.3"]])
def test_an_admission_knob_without_admission_is_refused_not_ignored(capsys, tmp_path, knob) -> None:
    for command in (["serve", "--predictor", "none"],
                    ["simulate", "--predictions", "noisy-oracle", "--json", str(tmp_path / "sim.json")]):
        err = one_line_error(capsys, [*command, *knob], command[0])
        assert f"{knob[0]} needs --admission" in err
    assert not (tmp_path / "sim.json").exists()


def test_scheduler_knobs_parse_their_bounds_and_only_admission_knobs_need_admission() -> None:
    import argparse

    from engine.arg_types import share_of_one
    from engine.scheduler_args import add_scheduler_arguments, scheduler_options

    parser = argparse.ArgumentParser()
    add_scheduler_arguments(parser)
    assert scheduler_options(parser.parse_args(["--srpt-max-preempt-share", "0"])) == {
        "enable_admission": False, "srpt_max_preempt_share": 0.0}  # 0 is a share: never preempt
    assert (share_of_one("0"), share_of_one("1")) == (0.0, 1.0)
    assert "(default 0.25)" in parser.format_help() and "(default 10)" in parser.format_help()


# Each bounded argparse type: the edge values it takes, those just past them, and nan.
BOUNDED_TYPES = {
    "positive_int": (["1"], ["0", "-3"]), "non_negative_int": (["0"], ["-1"]), "ranked_rows": (["2"], ["1"]),
    "port_number": (["0", "65535"], ["-1", "65536"]), "top_k": (["-1", "0"], ["-2"]),
    "sampling_seed": ([str(-2 ** 63), str(2 ** 64 - 1)], [str(-2 ** 63 - 1), str(2 ** 64)]),
    "positive_float": (["1e-9"], ["0", "inf", "nan"]), "positive_rate": (["1e-9", "inf"], ["0", "nan"]),
    "non_negative_float": (["0"], ["-1e-9", "inf", "nan"]), "top_p": (["1"], ["0", "1.0001", "nan"]),
    "share_of_one": (["0", "1"], ["-0.1", "1.1", "nan"]), "share_above_zero": (["1e-9", "1"], ["0", "1.1", "nan"]),
}


@pytest.mark.parametrize("name", sorted(BOUNDED_TYPES))
def test_bounded_argument_types_take_their_edges_and_refuse_past_them(name) -> None:
    import argparse

    from engine import arg_types
    from scheduler.request import SEED_MAX, SEED_MIN

    assert (SEED_MIN, SEED_MAX) == (-2 ** 63, 2 ** 64 - 1)  # the edges sampling_seed is checked at
    parse = getattr(arg_types, name)
    good, bad = BOUNDED_TYPES[name]
    for text in good:
        assert parse(text) == (int(text) if isinstance(parse(text), int) else float(text))
    for text in bad:
        with pytest.raises(argparse.ArgumentTypeError, match=f", got {text}$"):
            parse(text)
    parser = argparse.ArgumentParser(prog="p", exit_on_error=False)
    parser.add_argument("--x", type=parse)
    with pytest.raises(argparse.ArgumentError, match=f"invalid {name} value: 'junk'"):
        parser.parse_args(["--x", "junk"])


def test_a_fixed_aging_rate_beside_the_per_step_one_is_refused_not_ignored(capsys, tmp_path) -> None:
    # --aging-tokens-per-s replaces the per-step rate: the other had been accepted and not read.
    both = ["--aging-tokens-per-step", "0.5", "--aging-tokens-per-s", "3"]
    for command in (["serve", "--predictor", "none", "--policy", "sjf"],
                    ["simulate", "--predictions", "noisy-oracle", "--json", str(tmp_path / "sim.json")]):
        err = one_line_error(capsys, [*command, *both], command[0])
        assert "--aging-tokens-per-s replaces --aging-tokens-per-step: give one of them" in err
    assert not (tmp_path / "sim.json").exists()


def test_bench_engine_refuses_a_context_that_would_cut_the_engines_replies(capsys, tmp_path, tiny_model_dir,
                                                                          monkeypatch):
    # The engine ends a reply at max_model_len where the HF baselines run on: a ratio of unequal work.
    from training import bench_engine

    monkeypatch.setattr(bench_engine, "run_engine", lambda *args: pytest.fail("ran before the check"))
    assert "exceed --max-model-len 64" in one_line_error(
        capsys, ["bench", "engine", "--model", str(tiny_model_dir), "--max-prompt-tokens", "60",
                 "--max-output-tokens", "40", "--max-model-len", "64", "--json", str(tmp_path / "b.json")],
        "bench engine")


def test_train_checks_its_save_path_before_training(capsys, tmp_path, monkeypatch):
    # It had been checked after the training, whose work was then lost.
    from training import train

    monkeypatch.setattr(train, "load_data", lambda *args, **kwargs: pytest.fail("trained before --save was checked"))
    store = ["--store", str(tmp_path / "store")]
    assert "--save /proc/nope/p: not writable" in one_line_error(
        capsys, ["train", "--model", "length", "--save", "/proc/nope/p", *store], "train")
    (tmp_path / "file").write_text("x")
    assert "is a file, not a folder" in one_line_error(
        capsys, ["train", "--model", "length", "--save", str(tmp_path / "file" / "sub"), *store], "train")


def test_trace_refuses_one_file_for_its_log_and_its_table(capsys, tmp_path, tiny_model_dir):
    # The table overwrote the resume log, and the next run failed on its bytes.
    same = tmp_path / "t"
    assert "the same file as --log" in one_line_error(
        capsys, ["trace", "--num-prompts", "1", "--model", str(tiny_model_dir), "--log", str(same),
                 "--out", str(same)], "trace")
    assert not same.exists()


@pytest.mark.parametrize("url", ["http://127.0.0.1:8x", "http://[::1"])
def test_bench_serve_names_a_base_url_httpx_cannot_parse(capsys, tmp_path, url):
    # httpx.InvalidURL is no HTTPError: it had been a 47-line traceback.
    assert "cannot list its models" in one_line_error(
        capsys, ["bench", "serve", "--base-url", url, "--no-mlflow", "--result-dir", str(tmp_path / "r")],
        "bench serve")


@pytest.mark.parametrize("status, url, key, hint", [
    (401, "http://127.0.0.1:1", [], "the server wants an API key: pass --api-key or set $LENGTHWISE_API_KEY"),
    (401, "http://127.0.0.1:1", ["--api-key", "k"], "the server refused this key (--api-key)"),
    (404, "http://127.0.0.1:1/v1", [], "--base-url is the server's root, without the /v1"),
    (404, "http://127.0.0.1:1", [], None),
])
def test_bench_serve_says_what_a_refused_model_list_means(capsys, tmp_path, monkeypatch, status, url, key, hint):
    # A 401 or a 404 on /v1/v1/models said only "Client error '401 Unauthorized'".
    import httpx

    from training import bench_serve

    monkeypatch.setattr(bench_serve.httpx, "get", lambda target, **kwargs: httpx.Response(
        status, request=httpx.Request("GET", target)))
    monkeypatch.delenv("LENGTHWISE_API_KEY", raising=False)
    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    err = one_line_error(capsys, ["bench", "serve", "--base-url", url, *key, "--no-mlflow", "--result-dir",
                                  str(tmp_path / "r")], "bench serve")
    assert f"cannot list its models (Client error '{status}" in err
    if hint is None:
        assert "API key" not in err and "/v1 an OpenAI" not in err
    else:
        assert hint in err


@pytest.fixture
def broken_model(tmp_path, tiny_model_dir):
    """A copy of the tiny model whose file `name` is replaced by `text`."""
    import shutil

    def make(name: str, text: str | None) -> Path:
        folder = tmp_path / f"model-{len(list(tmp_path.iterdir()))}"
        shutil.copytree(tiny_model_dir, folder)
        (folder / name).unlink()
        if text is not None:
            (folder / name).write_text(text)
        return folder

    return make


def test_a_model_folder_with_a_broken_file_is_one_line_naming_it(capsys, tiny_model_dir, broken_model) -> None:
    # A config lacking a field or holding a list was a KeyError or AttributeError traceback, a
    # weights file cut short a SafetensorError one; bad JSON was one line naming no file.
    config = json.loads((tiny_model_dir / "config.json").read_text())
    lacking = json.dumps({k: v for k, v in config.items() if k != "num_attention_heads"})
    cases = [("config.json", lacking, "config.json: not a Llama config (KeyError: 'num_attention_heads'"),
             ("config.json", "[]", "config.json: a JSON object is expected, got list"),
             ("config.json", "{bad", "config.json: not JSON"),
             ("generation_config.json", "{", "generation_config.json: not JSON"),
             ("model.safetensors", "junk", "model.safetensors: not a whole safetensors file"),
             ("tokenizer.json", None, "its tokenizer does not load")]
    for name, text, message in cases:
        model = broken_model(name, text)
        err = one_line_error(capsys, ["generate", "hi", "--model", str(model), "--kv-cache-memory", "0.01"],
                             "generate")
        assert message in err and (name == "tokenizer.json" or str(model / name) in err), err


def lexical_copy(tmp_path) -> Path:
    import shutil

    folder = tmp_path / "lexical"
    shutil.copytree(Path(__file__).resolve().parents[1] / "data" / "predictors" / "lexical", folder)
    return folder


def test_a_predictor_with_a_broken_weights_file_is_one_line(capsys, tmp_path) -> None:
    # LightGBM's error is no ValueError: a 36-line traceback from eval-predictor, simulate and serve.
    folder = lexical_copy(tmp_path)
    (folder / "point.lgb.txt").write_text("junk\n")
    err = one_line_error(capsys, ["eval-predictor", "--predictor", str(folder), "--limit", "2", "--no-latency"],
                         "eval-predictor")
    assert f"{folder}: its lexical predictor does not load (LightGBMError" in err


def test_serve_reads_the_predictor_spec_before_loading_the_model(capsys, tmp_path, tiny_model_dir,
                                                                 monkeypatch) -> None:
    from engine.server import serve_cli

    monkeypatch.setattr(serve_cli, "build_server", lambda *args: pytest.fail("loaded before the spec was read"))
    folder = lexical_copy(tmp_path)
    (folder / "predictor.json").write_text("{")
    err = one_line_error(capsys, ["serve", "--model", str(tiny_model_dir), "--predictor", str(folder),
                                  "--port", "0"], "serve")
    assert "predictor.json: not a predictor spec (not JSON" in err


@pytest.mark.parametrize("text, message", [
    ('{"a": Infinity, "b": 0, "c": 0}', "must be finite"),  # a ZeroDivisionError traceback
    ('{"a": 0.03, "b": NaN, "c": 0}', "must be finite"),  # NaN had been clamped to 0 and run
    ('{"a": 0, "b": 0, "c": 1e-5}', "a_s + b_s_per_token > 0"),  # a step with no context would take no time
    ('{"a": 0.03, "b": 0, "c": 0, "num_gpu_blocks": "x"}', "num_gpu_blocks must be a positive integer"),
    ('{"a": 0.03, "b": 0, "c": 0, "num_gpu_blocks": 0}', "num_gpu_blocks must be a positive integer"),
    ('{"a": 0.03, "b": 0, "c": 0, "block_size": 0, "num_gpu_blocks": 8}', "block_size must be a positive integer"),
])
def test_a_step_cost_file_of_impossible_numbers_is_one_line(capsys, tmp_path, text, message) -> None:
    cost = tmp_path / "cost.json"
    cost.write_text(text)
    err = one_line_error(capsys, ["simulate", "--step-cost", str(cost), "--predictions", "noisy-oracle",
                                  "--num-requests", "2", "--json", str(tmp_path / "s.json"), "--no-plots"],
                         "simulate")
    assert f"--step-cost {cost}: not a step-cost file" in err and message in err


def test_a_step_cost_whose_steps_overflow_is_one_line(capsys, tmp_path) -> None:
    # Finite coefficients, but a step of 1e308 s plus 1e308 s per token is inf: a ZeroDivisionError.
    cost = tmp_path / "cost.json"
    cost.write_text('{"a": 1e308, "b": 1e308, "c": 0}')
    assert "not a usable cost model" in one_line_error(
        capsys, ["simulate", "--step-cost", str(cost), "--predictions", "noisy-oracle", "--num-requests", "2",
                 "--sweep-loads=", "--json", str(tmp_path / "s.json"), "--no-plots"], "simulate")
    assert not (tmp_path / "s.json").exists()


def test_simulate_refuses_more_kv_blocks_than_it_can_list(capsys, tmp_path, monkeypatch) -> None:
    # --kv-blocks 10**12 filled memory until the kernel killed the process.
    from training import simulate

    monkeypatch.setattr(simulate, "load_workload_turns", lambda args: pytest.fail("ran before the check"))
    base = ["simulate", "--predictions", "noisy-oracle", "--json", str(tmp_path / "s.json")]
    assert "--kv-blocks: 1000000000000 KV blocks of 16 is more than the simulator keeps" in one_line_error(
        capsys, [*base, "--kv-blocks", str(10**12)], "simulate")
    cost = tmp_path / "cost.json"
    cost.write_text('{"a": 0.03, "b": 0, "c": 0, "num_gpu_blocks": 99999999999}')
    assert "calibration's num_gpu_blocks: 99999999999 KV blocks" in one_line_error(
        capsys, [*base, "--step-cost", str(cost)], "simulate")


def write_table(path: Path, columns: dict) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table(columns), path)
    return path


def test_a_trace_table_of_the_wrong_types_or_no_rows_is_one_line(capsys, tmp_path) -> None:
    # Text lengths or int keys matched nothing and exited 0 (a NaN tau); an empty table was a
    # 47-line datasets traceback.
    import pyarrow as pa

    tables = {"texts": ({"key": ["a"], "output_tokens": ["x"]}, "output_tokens is string, not integers"),
              "ints": ({"key": [1], "output_tokens": [1]}, "key is int64, not text"),
              "empty": ({"key": pa.array([], pa.string()), "output_tokens": pa.array([], pa.int64())},
                        "the trace table holds no rows")}
    for name, (columns, message) in tables.items():
        path = write_table(tmp_path / f"{name}.parquet", columns)
        assert message in one_line_error(capsys, ["trace", "--agreement", str(path)], "trace")
        assert message in one_line_error(
            capsys, ["eval-predictor", "--predictor", "data/predictors/lexical", "--labels", "trace", "--resample",
                     str(path), "--limit", "2", "--no-latency"], "eval-predictor")


def test_trace_agreement_with_no_shared_prompt_is_one_line_not_nan(capsys, tmp_path) -> None:
    # It printed {"num_prompts": 0, "kendall_tau_two_samples": NaN}, which is no JSON, and exited 0.
    from training.trace import sample_agreement

    path = write_table(tmp_path / "other.parquet", {"key": ["zz", "yy"], "output_tokens": [3, 4]})
    assert main(["trace", "--agreement", str(path)]) == 2
    captured = capsys.readouterr()  # datasets' progress lines come first on stderr
    assert "shares 0 prompts with" in captured.err.splitlines()[-1] and captured.out == ""
    assert sample_agreement(path, path)["num_prompts"] == 2
    single = write_table(tmp_path / "one.parquet", {"key": ["zz"], "output_tokens": [3]})
    assert sample_agreement(single, single) == {"num_prompts": 1, "kendall_tau_two_samples": None}


def test_trace_agreement_refuses_the_trace_itself_and_samples_of_one_length(capsys, tmp_path) -> None:
    # The trace against itself read a perfect 0.9999999999999998; a resample cut at a tiny cap,
    # every length the same, printed NaN (no JSON) and a ceiling fitted to it.
    import shutil

    from training.trace import DEFAULT_TRACE, load_trace, sample_agreement

    copy = tmp_path / "copy.parquet"
    shutil.copy(DEFAULT_TRACE, copy)
    assert "holds the trace itself" in one_line_error(capsys, ["trace", "--agreement", str(copy)], "trace")
    keys = load_trace("test")["key"][:4]
    flat = write_table(tmp_path / "flat.parquet", {"key": keys, "output_tokens": [8] * 4})
    assert sample_agreement(DEFAULT_TRACE, flat) == {"num_prompts": 4, "kendall_tau_two_samples": None}
    assert main(["trace", "--agreement", str(flat)]) == 2
    captured = capsys.readouterr()  # datasets' progress lines come first on stderr
    assert "have one length in one of the samples" in captured.err.splitlines()[-1] and captured.out == ""


def test_a_resample_at_another_cap_or_temperature_is_refused_before_loading(capsys, tmp_path, tiny_model_dir,
                                                                            monkeypatch) -> None:
    import engine.llm

    monkeypatch.setattr(engine.llm, "LLM", lambda **kwargs: pytest.fail("the model loaded"))
    base = ["trace", "--num-prompts", "4", "--resample-split", "test", "--seed", "7", "--model", str(tiny_model_dir),
            "--log", str(tmp_path / "r.jsonl"), "--out", str(tmp_path / "r.parquet")]
    for flags, asked in ((["--max-tokens", "8"], "8 and 1"), (["--temperature", "0.5"], "256 and 0.5")):
        assert f"pass --max-tokens 256 --temperature 1 (this run asks {asked})" in one_line_error(
            capsys, base + flags, "trace")
    assert not (tmp_path / "r.jsonl").exists()


def test_trace_checks_an_existing_out_table_before_loading_the_model(capsys, tmp_path, tiny_model_dir,
                                                                    monkeypatch) -> None:
    # The table is resumed from once the model has loaded: a KeyError traceback after the load.
    from engine import llm

    monkeypatch.setattr(llm, "LLM", lambda *args, **kwargs: pytest.fail("loaded before --out was checked"))
    out = write_table(tmp_path / "other.parquet", {"x": [1, 2]})
    assert f"--out {out}: not a trace table (no column conversation_id, finish_reason, in_train, key, " \
           "output_tokens, prompt, prompt_tokens, split, turn_index)" in one_line_error(
        capsys, ["trace", "--num-prompts", "1", "--model", str(tiny_model_dir), "--log", str(tmp_path / "t.jsonl"),
                 "--out", str(out)], "trace")
    # Key and lengths alone pass for an agreement, but a resumed table is copied into the log.
    keys_only = write_table(tmp_path / "keys.parquet", {"key": ["abc"], "output_tokens": [3]})
    assert "no column conversation_id, finish_reason, in_train, prompt, prompt_tokens, split, turn_index" in \
        one_line_error(capsys, ["trace", "--num-prompts", "1", "--model", str(tiny_model_dir), "--log",
                                str(tmp_path / "t.jsonl"), "--out", str(keys_only)], "trace")
    assert not (tmp_path / "t.jsonl").exists()


def test_bench_serve_refuses_a_label_too_long_for_a_file_name(capsys, monkeypatch) -> None:
    # File name too long came after the whole load test, whose results were then lost.
    from training import bench_serve

    monkeypatch.setattr(bench_serve, "server_model", lambda args: pytest.fail("load started first"))
    assert "argument --label: a run name becomes a file name: at most 239 bytes, got 300" in usage_error(
        capsys, ["bench", "serve", "--label", "a" * 300, "--no-mlflow"])
    assert "got 240" in usage_error(capsys, ["bench", "serve", "--label", "é" * 120, "--no-mlflow"])


def a_server_serving_m(monkeypatch, max_model_len: int) -> None:
    """bench serve's /v1/models answers model "m" with this context; a load that starts fails."""
    import httpx

    from training import bench_serve

    listed = {"object": "list", "data": [{"id": "m", "object": "model", "max_model_len": max_model_len}]}
    monkeypatch.setattr(bench_serve.httpx, "get", lambda url, **kwargs: httpx.Response(
        200, json=listed, request=httpx.Request("GET", url)))
    monkeypatch.setattr(bench_serve, "sample_workload", lambda args: pytest.fail("load started first"))


def test_bench_serve_refuses_a_context_above_the_servers(capsys, tmp_path, monkeypatch) -> None:
    # Every turn longer than the server's context was refused (HTTP 400): a load test of failures,
    # exit 1, and a result written over an earlier run's of the same label.
    a_server_serving_m(monkeypatch, 512)
    out = ["--base-url", "http://127.0.0.1:1", "--no-mlflow", "--result-dir", str(tmp_path / "r")]
    assert "--max-model-len 2048 exceeds the server's max_model_len 512" in one_line_error(
        capsys, ["bench", "serve", *out], "bench serve")
    with pytest.raises(pytest.fail.Exception, match="load started first"):  # 512 passes the check
        main(["bench", "serve", *out, "--max-model-len", "512"])
    assert not (tmp_path / "r").exists()


def test_bench_serve_refuses_a_model_the_server_does_not_serve(capsys, tmp_path, monkeypatch) -> None:
    # Every request for it was a 404: a load test of failures, exit 1, and a result written anyway.
    a_server_serving_m(monkeypatch, 4096)
    out = ["--base-url", "http://127.0.0.1:1", "--no-mlflow", "--result-dir", str(tmp_path / "r")]
    assert "--model 'other': the server at http://127.0.0.1:1 serves 'm'" in one_line_error(
        capsys, ["bench", "serve", *out, "--model", "other"], "bench serve")
    for model in (["--model", "m"], []):  # the served name, or none (the server's first), passes the check
        with pytest.raises(pytest.fail.Exception, match="load started first"):
            main(["bench", "serve", *out, *model])
    assert not (tmp_path / "r").exists()


def test_data_prepare_refuses_a_card_dir_beside_no_card(capsys, tmp_path, monkeypatch) -> None:
    from training import data_prepare

    monkeypatch.setattr(data_prepare, "prepare", lambda *args: pytest.fail("ran with a folder it ignores"))
    assert "--card-dir names where the card goes, --no-card skips it" in one_line_error(
        capsys, ["data", "prepare", "--out", str(tmp_path / "t"), "--no-card", "--card-dir", str(tmp_path / "c")],
        "data prepare")


def test_bench_serve_checks_the_mlflow_store_before_the_load(capsys, tmp_path, monkeypatch) -> None:
    # The run is logged once the load is over: a store it could not write failed only then.
    from training import bench_serve, tracking

    monkeypatch.setattr(bench_serve, "server_model", lambda args: pytest.fail("load started first"))
    in_the_way = tmp_path / "mlruns"
    in_the_way.write_text("x")
    monkeypatch.setattr(tracking, "default_store", lambda: in_the_way)
    assert f"the MLflow store {in_the_way} is a file, not a folder" in one_line_error(
        capsys, ["bench", "serve", "--result-dir", str(tmp_path / "r")], "bench serve")


def test_bench_engine_refuses_more_threads_than_cpus(capsys, tmp_path) -> None:
    # --threads 100000 was a segmentation fault (exit 139, no message) once torch started them.
    import os

    cpus = len(os.sched_getaffinity(0))
    # No model there: a run past the flag check would end at once, not benchmark.
    err = usage_error(capsys, ["bench", "engine", "--threads", str(cpus + 1), "--model", str(tmp_path / "none"),
                               "--json", str(tmp_path / "b.json")])
    assert f"argument --threads: this machine gives {cpus} CPUs to the process, got {cpus + 1} threads" in err


@pytest.mark.parametrize("text, message", [
    ("# my notes\nkeep this line", "not a trace log (no line is a JSON record)"),
    ('{"a": 1}\n', "line 1 is no trace record"), ("[1]\n", "line 1 is no trace record")])
def test_trace_refuses_a_log_that_is_no_trace_log_before_loading(capsys, tmp_path, tiny_model_dir, monkeypatch,
                                                                 text, message) -> None:
    # Notes given as --log lost their last line and took JSON lines (exit 0); records of another
    # kind were a KeyError or AttributeError traceback once the model had loaded.
    from engine import llm

    monkeypatch.setattr(llm, "LLM", lambda *args, **kwargs: pytest.fail("loaded before --log was checked"))
    log = tmp_path / "notes.md"
    log.write_text(text)
    assert f"--log {log}: {message}" in one_line_error(
        capsys, ["trace", "--num-prompts", "1", "--model", str(tiny_model_dir), "--log", str(log),
                 "--out", str(tmp_path / "t.parquet")], "trace")
    assert log.read_text() == text


@pytest.mark.parametrize("logged", [{"max_prompt_tokens": 300}, {"temperature": 0.5}])
def test_trace_refuses_to_resume_a_log_sampled_otherwise_before_loading(capsys, tmp_path, tiny_model_dir, monkeypatch,
                                                                        logged) -> None:
    # Found after the model loaded, and after the committed table's rows were copied into the log.
    from engine import llm

    monkeypatch.setattr(llm, "LLM", lambda *args, **kwargs: pytest.fail("loaded before the settings were checked"))
    log = tmp_path / "t.jsonl"
    text = json.dumps({"key": "k", "conversation_id": "c", "turn_index": 0, "prompt": "p", "prompt_tokens": 1,
                       "output_tokens": 3, "finish_reason": "stop", "split": "test", "in_train": False,
                       "max_tokens": 256, "temperature": 1.0, "seed": 0, "max_prompt_tokens": 384, **logged}) + "\n"
    log.write_text(text)
    name = next(iter(logged))
    message = "at most 300 tokens, this run draws from those of at most 384" if name == "max_prompt_tokens" else \
        "sampled with temperature 0.5, this run asks 1.0"
    assert message in one_line_error(
        capsys, ["trace", "--num-prompts", "1", "--model", str(tiny_model_dir), "--log", str(log),
                 "--out", str(tmp_path / "t.parquet")], "trace")
    assert log.read_text() == text


def test_a_log_cut_off_in_its_first_record_still_resumes(tmp_path) -> None:
    from training.trace import read_log

    log = tmp_path / "t.jsonl"
    log.write_text('{"key": "0123456789abcdef", "output_tok')  # killed while writing the first line
    assert read_log(log) == []
    record = {"key": "k", "conversation_id": "c", "turn_index": 0, "prompt": "p", "prompt_tokens": 1,
              "output_tokens": 3, "finish_reason": "stop", "split": "test", "in_train": False}
    log.write_text(json.dumps(record) + '\n{"key": "0123')
    assert read_log(log) == [record]


def test_generate_help_names_the_defaults_a_vllm_user_would_not_expect(capsys) -> None:
    # Greedy by default, and each prompt a user message in the chat template: --help said neither.
    from training.cli import main

    with pytest.raises(SystemExit):
        main(["generate", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "default 0.0: greedy" in text and "wrapped in the model's chat template" in text
    assert "--max-tokens MAX_TOKENS default 128" in text
