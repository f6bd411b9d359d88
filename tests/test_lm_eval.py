"""lm-evaluation-harness on plait models: the ``plait`` backend against lm-eval's own ``hf``.

One tiny random Llama, saved by ``transformers`` with a byte-level BPE, and three local tasks
written here (a multiple-choice one with an empty and an over-long question, a perplexity one
whose documents need several rolling windows, a generation one with an over-long prompt), since
nothing can be downloaded. The model's context is 32 tokens so that truncation and windows are
exercised. Both backends run in fp32 on the CPU through the same tokenizer, so every score and
every per-request log-likelihood must agree to 1e-4 (the models differ only in the order of
their float operations; measured about 1e-6), and every generated text must be equal. The TP=2
run (gloo, two processes) must give the single-process scores.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")  # local JSONL files only, nothing from a hub
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from chat_task import chat_tokenizer  # noqa: E402
from distributed import run_distributed  # noqa: E402
from plait.cli import main  # noqa: E402

pytest.importorskip("lm_eval")
transformers = pytest.importorskip("transformers")

#: fp32 on both sides: the same model computed in a different operation order
TOL = 1e-4
TASKS = ("tiny_mc", "tiny_ppl", "tiny_gen")
TEXT = "the cat sat on the mat. a dog ran in the park. one two three four five six seven eight. "
WORDS = ["cat", "dog", "mat", "park", "one", "two", "seven", "the"]


def _task_yaml(name: str, data: str, body: str) -> str:
    return (f"task: {name}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {data}\n"
            f"test_split: test\n{body}")


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("lm_eval")
    tok = chat_tokenizer(TEXT * 20, 300)
    config = transformers.LlamaConfig(vocab_size=tok.get_vocab_size(), hidden_size=32, intermediate_size=64,
                                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                      max_position_embeddings=32, bos_token_id=None, eos_token_id=0,
                                      tie_word_embeddings=False)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    model.save_pretrained(root / "model")
    tok.save(str(root / "model" / "tokenizer.json"))
    (root / "model" / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|endoftext|>"}))

    questions = [f"the {w} sat on the" for w in WORDS] + ["", " ".join(WORDS * 3)]  # empty; past 32 tokens
    mc = [{"question": q, "choices": ["mat", "park", "dog ran", "seven"], "answer": i % 4}
          for i, q in enumerate(questions)]
    docs = [{"text": (TEXT * (k + 1)).strip()} for k in range(4)]  # up to ~4 windows of 32 tokens
    gen = [{"question": q, "answer": " four"} for q in ["one two three", "the cat", TEXT * 2]]
    tasks = root / "tasks"
    tasks.mkdir()
    for name, rows in (("mc", mc), ("docs", docs), ("gen", gen)):
        (root / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tasks / "mc.yaml").write_text(_task_yaml("tiny_mc", root / "mc.jsonl", (
        'output_type: multiple_choice\ndoc_to_text: "{{question}}"\ndoc_to_choice: "{{choices}}"\n'
        "doc_to_target: answer\nmetric_list:\n  - metric: acc\n  - metric: acc_norm\n")))
    (tasks / "ppl.yaml").write_text(_task_yaml("tiny_ppl", root / "docs.jsonl", (
        'output_type: loglikelihood_rolling\ndoc_to_text: ""\ndoc_to_target: "{{text}}"\nmetric_list:\n'
        "  - metric: word_perplexity\n  - metric: byte_perplexity\n  - metric: bits_per_byte\n")))
    (tasks / "gen.yaml").write_text(_task_yaml("tiny_gen", root / "gen.jsonl", (
        'output_type: generate_until\ndoc_to_text: "{{question}}"\ndoc_to_target: "{{answer}}"\n'
        'generation_kwargs:\n  until: ["."]\n  max_gen_toks: 6\n  do_sample: false\n'
        "metric_list:\n  - metric: exact_match\n")))
    return {"root": root, "model": root / "model", "tasks": tasks}


def _run(lm, setup):
    from plait.evaluation.harness import run_tasks, task_manager

    manager = task_manager(TASKS, setup["tasks"])
    done = run_tasks(lm, TASKS, manager, bootstrap_iters=0, log_samples=True)
    assert done is not None
    rows, results = done
    return {(r.task, r.metric): r.value for r in rows}, _responses(results)


def _responses(results) -> dict:
    """``{(task, doc id, request index): response}`` of lm-eval's logged samples."""
    out = {}
    for task, samples in results["samples"].items():
        for sample in samples:
            for i, resp in enumerate(sample["resps"]):
                out[(task, sample["doc_id"], i)] = resp[0]
    return out


@pytest.fixture(scope="module")
def plait_run(setup):
    from plait.evaluation.lm_eval_model import PlaitLM

    return _run(PlaitLM(str(setup["model"]), batch_size=3), setup)


def _close(a: float, b: float) -> bool:
    return abs(a - b) <= TOL * max(1.0, abs(b))  # perplexities are ~1e3: relative there


def test_plait_backend_gives_the_scores_of_lm_evals_hf_backend(setup, plait_run):
    from lm_eval.models.huggingface import HFLM

    scores, responses = plait_run
    hf_scores, hf_responses = _run(HFLM(pretrained=str(setup["model"]), dtype="float32", device="cpu",
                                        batch_size=3), setup)
    assert set(scores) == set(hf_scores) and len(scores) == 6
    bad = {k: (scores[k], hf_scores[k]) for k in scores if not _close(scores[k], hf_scores[k])}
    assert not bad, bad
    assert responses.keys() == hf_responses.keys()
    kinds = {"tiny_mc": 0, "tiny_ppl": 0, "tiny_gen": 0}
    worst = 0.0
    for key, ours in responses.items():
        theirs = hf_responses[key]
        kinds[key[0]] += 1
        if key[0] == "tiny_mc":  # (log-probability, is greedy)
            worst = max(worst, abs(ours[0] - theirs[0]))
            assert ours[1] == theirs[1] and abs(ours[0] - theirs[0]) <= TOL, (key, ours, theirs)
        elif key[0] == "tiny_ppl":
            worst = max(worst, abs(ours - theirs))
            assert abs(ours - theirs) <= TOL, (key, ours, theirs)
        else:
            assert ours == theirs, (key, ours, theirs)
    assert kinds == {"tiny_mc": 40, "tiny_ppl": 4, "tiny_gen": 3}, kinds
    # not vacuous: real log-likelihoods, and text that was generated
    assert all(responses[("tiny_ppl", d, 0)] < -10 for d in range(4))
    assert any(responses[("tiny_gen", d, 0)] for d in range(3))
    print(f"largest per-request difference from lm-eval's hf backend: {worst:.2e}")


def test_rolling_windows_are_lm_evals_windows():
    from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

    from plait.evaluation.scoring import rolling_windows

    for n in (1, 5, 8, 9, 16, 17, 40):
        for max_len in (1, 4, 8):
            tokens = list(range(10, 10 + n))
            theirs = [make_disjoint_window(w) for w in get_rolling_token_windows(tokens, 7, max_len, 1)]
            ours = [(list(w.context), list(w.continuation)) for w in rolling_windows(tokens, 7, max_len)]
            assert ours == theirs, (n, max_len)
            assert [t for _, cont in ours for t in cont] == tokens  # each token predicted once


def test_greedy_continuation_from_the_engine_is_greedy_to_the_scorer(setup):
    """The KV-cache engine's greedy tokens are what the training forward calls greedy, and one
    token changed is not (a check that is_greedy can be False and True)."""
    from plait.evaluation.lm_eval_model import load_eval_model
    from plait.evaluation.scoring import ScoreRequest, score_continuations
    from plait.inference import generate_tokens

    model, _ = load_eval_model(setup["model"])
    prompt = [5, 9, 14, 3]
    new = generate_tokens(model, [prompt], 6)[0].tokens
    other = new[:-1] + [(new[-1] + 1) % model.config.vocab_size]
    scores = score_continuations(model, [ScoreRequest(prompt, new), ScoreRequest(prompt, other)], max_length=32)
    assert scores[0].is_greedy and not scores[1].is_greedy
    assert scores[0].logprob > scores[1].logprob


# ------------------------------------------------------------------------------ TP = 2
def _tp_worker(rank: int, world: int, model_dir: str, tasks_dir: str) -> tuple:
    from plait.evaluation.harness import run_tasks, task_manager
    from plait.evaluation.lm_eval_model import PlaitLM
    from plait.evaluation.run import tp_mesh

    lm = PlaitLM(model_dir, mesh=tp_mesh(model_dir, world, rank), batch_size=3)
    assert lm.model.tensor_parallel.size == 2
    done = run_tasks(lm, TASKS, task_manager(TASKS, tasks_dir), bootstrap_iters=0, log_samples=True)
    assert done is not None
    rows, results = done
    return {(r.task, r.metric): r.value for r in rows}, _responses(results)


def test_tp2_gives_the_single_process_scores(setup, plait_run):
    scores, responses = plait_run
    worst = 0.0
    for tp_scores, tp_responses in run_distributed(_tp_worker, 2, str(setup["model"]), str(setup["tasks"])):
        assert set(tp_scores) == set(scores)
        assert all(_close(tp_scores[k], scores[k]) for k in scores), (tp_scores, scores)
        for key, ours in responses.items():
            theirs = tp_responses[key]
            if key[0] == "tiny_mc":
                worst = max(worst, abs(ours[0] - theirs[0]))
                assert ours[1] == theirs[1] and abs(ours[0] - theirs[0]) <= TOL, (key, ours, theirs)
            elif key[0] == "tiny_ppl":
                worst = max(worst, abs(ours - theirs))
                assert abs(ours - theirs) <= TOL, (key, ours, theirs)
            else:
                assert ours == theirs, (key, ours, theirs)
    print(f"largest per-request difference of TP=2 from one process: {worst:.2e}")


def test_the_plait_model_is_registered_with_lm_eval(setup):
    """``lm_eval.simple_evaluate(model="plait", model_args="pretrained=DIR,...")`` finds it (once
    plait.evaluation.lm_eval_model is imported); a batch size lm-eval's string arguments give
    is read, and one the model cannot honour is refused by name."""
    from lm_eval.api.registry import get_model

    from plait.evaluation.errors import LmEvalError
    from plait.evaluation.lm_eval_model import PlaitLM

    assert get_model("plait") is PlaitLM
    lm = PlaitLM.create_from_arg_string(f"pretrained={setup['model']},batch_size=2")
    assert lm.batch_size == 2 and lm.max_length == 32 and lm.prefix_token_id == lm.eot_token_id == 0
    with pytest.raises(LmEvalError, match="'auto' is not supported"):
        PlaitLM.create_from_arg_string(f"pretrained={setup['model']},batch_size=auto")
    with pytest.raises(LmEvalError, match="not options of the plait model"):
        PlaitLM.create_from_arg_string(f"pretrained={setup['model']},trust_remote_code=True")


# ------------------------------------------------------------------------------ the command
def _plait(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(["eval", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_command_prints_the_metrics_as_a_table_and_as_json(setup, plait_run, capsys):
    scores, _ = plait_run
    common = [str(setup["model"]), "--lm-eval", "tiny_mc,tiny_ppl", "--lm-eval-include", str(setup["tasks"])]
    code, out, err = _plait(capsys, *common, "--json")
    assert code == 0, err
    line, = out.strip().splitlines()
    found = json.loads(line)
    assert found["tasks"] == ["tiny_mc", "tiny_ppl"]
    got = {(m["task"], m["metric"]): m["value"] for m in found["metrics"]}
    assert got.keys() == {k for k in scores if k[0] != "tiny_gen"}
    assert all(_close(v, scores[k]) for k, v in got.items())
    assert next(m for m in found["metrics"] if m["metric"] == "acc")["stderr"] > 0  # lm-eval's bootstrap-free stderr

    code, out, err = _plait(capsys, *common[:3], "--lm-eval-include", str(setup["tasks"]), "--limit", "2")
    assert code == 0, err
    lines = out.strip().splitlines()
    assert lines[0].split() == ["task", "metric", "value", "stderr"]
    assert any(line.split()[:2] == ["tiny_mc", "acc"] for line in lines)
    assert len(lines) == 6  # header + acc, acc_norm + three perplexity metrics


@pytest.mark.parametrize("argv, message", [
    (["MODEL"], "one of the arguments --data --lm-eval is required"),
    (["MODEL", "--data", "x.jsonl", "--lm-eval", "tiny_mc"], "not allowed with argument --data"),
    (["NOPE", "--lm-eval", "tiny_mc"], "no such directory"),
    (["MODEL", "--lm-eval", "tiny_mc", "--lm-eval-include", "NODIR"], "--lm-eval-include"),
    (["MODEL", "--lm-eval", "tiny_mc,", "--lm-eval-include", "TASKS"], "give task names separated by commas"),
    (["MODEL", "--lm-eval", "tiny_mc", "--kind", "sft"], "--kind sft applies to --data rows"),
    (["MODEL", "--lm-eval", "tiny_mc", "--max-new-tokens", "3"], "max_gen_toks"),
    (["MODEL", "--data", "x.jsonl", "--tp", "2"], "--tp applies to --lm-eval"),
    (["MODEL", "--lm-eval", "tiny_mc", "--lm-eval-include", "TASKS", "--tp", "3"], "intermediate_size=64"),
    (["MODEL", "--lm-eval", "tiny_mc", "--batch-size", "0"], "--batch-size 0 must be at least 1"),
])
def test_command_errors_are_one_line(setup, capsys, argv, message):
    paths = {"MODEL": str(setup["model"]), "NOPE": str(setup["root"] / "nope"), "TASKS": str(setup["tasks"]),
             "NODIR": str(setup["root"] / "no-tasks")}
    try:
        code = main(["eval", *[paths.get(a, a) for a in argv]])
    except SystemExit as e:  # usage errors of argparse (one line too: plait's parser)
        code = e.code
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and message in lines[0] and lines[0].startswith("plait eval"), err


def test_unknown_task_names_its_close_matches(setup):
    from plait.evaluation.errors import LmEvalError
    from plait.evaluation.harness import task_manager

    with pytest.raises(LmEvalError, match=r"unknown task 'tiny_mcq' \(close: tiny_mc") as e:
        task_manager(["tiny_mcq", "tiny_ppl"], setup["tasks"], include_defaults=False)
    assert "\n" not in str(e.value)
    assert task_manager(["tiny_mc", "tiny_ppl"], setup["tasks"]).all_tasks  # the local index suffices


def test_plait_command_does_not_import_lm_eval():
    code = ("import sys; from plait.cli import build_parser; build_parser(); "
            "import plait.commands.eval, plait.evaluation, plait.evaluation.scoring; "
            "assert 'lm_eval' not in sys.modules, 'lm_eval imported'")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


@pytest.mark.slow
def test_command_under_tp2_and_an_unknown_built_in_name(setup, plait_run, capsys):
    """``--tp 2`` launches two local ranks whose scores are one process's; a name lm-eval does not
    know, with no local task of that name, is looked up among the built-in tasks (seconds)."""
    scores, _ = plait_run
    code, out, err = _plait(capsys, str(setup["model"]), "--lm-eval", ",".join(TASKS), "--lm-eval-include",
                            str(setup["tasks"]), "--tp", "2", "--json")
    assert code == 0, err
    got = {(m["task"], m["metric"]): m["value"] for m in json.loads(out.strip().splitlines()[-1])["metrics"]}
    assert got.keys() == scores.keys() and all(_close(v, scores[k]) for k, v in got.items())
    code, _, err = _plait(capsys, str(setup["model"]), "--lm-eval", "hellaswagg")
    assert code == 2 and "unknown task 'hellaswagg' (close: hellaswag" in err and len(err.strip().splitlines()) == 1
    assert not math.isnan(scores[("tiny_ppl", "bits_per_byte")])
