"""What a model was trained with that changes how it is used travels with every model directory.

The tokenizer directory of these runs is shaped like the packaged SmolLM2's: ``tokenizer.json``,
a ``tokenizer_config.json`` without a template, the template in ``chat_template.jinja``, plus
``special_tokens_map.json`` and ``generation_config.json``. A LoRA and a full SFT run must write
them into the adapter / final directory, and ``plait convert`` (``--merge-lora``, checkpoint -> HF,
HF -> checkpoint) must carry them on; a changed template is a new prepared-data key; rows (and
text shards) record the tokenizer's sha256, so a tokenizer of the same size is refused, before
launch.
"""

from __future__ import annotations

import json
import shutil

import pytest

from chat_task import chat_tokenizer, task_with_tokenizer
from plait.cli import main
from plait.data.chat_template import load_chat_template
from plait.data.checks import verify_prepared
from plait.data.errors import DataError
from plait.data.prepare import prepare_dataset
from plait.data.sft_prepare import RowsSettings, check_rows_tokenizer, prepare_rows
from plait.data.tokenizer import load_tokenizer_file, tokenizer_vocab_size
from plait.data.tokenizer_files import file_sha256
from plait.materialize import build_model
from plait.mesh import single_process_mesh
from plait.models.hf_io import save_hf_checkpoint
from plait.models.llama.config import LlamaConfig

#: a template that is not plait's default ChatML (a role label after the marker)
TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}: {{ m['content'] }}<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant: {% endif %}")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json")
RUN = ["data.format=sft", "train.objective=sft", "data.seq_len=256", "data.val_fraction=0.1",
       "precision.preset=fp32", "optimizer.lr=3e-3", "scheduler.warmup_steps=0", "train.steps=2",
       "train.log_every=1", "train.eval_every=100", "train.sample_tokens=0", "logging.progress_bar=false",
       "logging.tensorboard=false", "logging.plot=false", "checkpoint.async_save=false", "parallel.tp=1",
       "parallel.sequence_parallel=false", "data.micro_batch_size=2", "parallel.microbatches=1"]


def _tokenizer_dir(directory, tokenizer_json, *, generation: bool):
    directory.mkdir()
    shutil.copyfile(tokenizer_json, directory / "tokenizer.json")
    (directory / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>", "bos_token": None}))
    (directory / "chat_template.jinja").write_text(TEMPLATE)
    (directory / "special_tokens_map.json").write_text(json.dumps({"eos_token": "<|im_end|>"}))
    if generation:
        (directory / "generation_config.json").write_text(json.dumps({"eos_token_id": 2, "max_new_tokens": 7}))
    return directory


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """The task files, a SmolLM2-shaped tokenizer directory (with and without a generation config)
    and a tiny base model (with and without one)."""
    root, paths = task_with_tokenizer(tmp_path_factory.mktemp("files"), seed=4, train=40, heldout=4)
    tok_gen = _tokenizer_dir(root / "tok-gen", root / "tokenizer.json", generation=True)
    tok = _tokenizer_dir(root / "tok", root / "tokenizer.json", generation=False)
    config = LlamaConfig(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    mesh = single_process_mesh()
    save_hf_checkpoint(build_model(config, mesh, seed=1), root / "base", mesh.info("tp"))
    shutil.copytree(root / "base", root / "base-gen")
    (root / "base-gen" / "generation_config.json").write_text(json.dumps({"eos_token_id": 2, "do_sample": False}))
    return {"root": root, "paths": paths, "tok": tok, "tok_gen": tok_gen}


def _same_files(directory, source, names) -> None:
    for name in names:
        assert (directory / name).is_file(), f"{directory} lacks {name}"
        assert (directory / name).read_bytes() == (source / name).read_bytes(), name


def _renders_the_template(directory) -> None:
    template = load_chat_template(directory / "tokenizer.json")
    assert template.text == TEMPLATE and template.source.endswith("chat_template.jinja"), template.source


def _train(setup, out, tokenizer_dir, extra: list[str]) -> None:
    items = [f"data.source={setup['paths']['sft_train']}", f"data.tokenizer={tokenizer_dir / 'tokenizer.json'}",
             f"data.cache_dir={setup['root'] / 'cache'}", f"run.output_dir={out}", *RUN, *extra]
    recipe = out.parent / "recipe.yaml"  # a recipe of its own: the built-in default sets model sizes
    recipe.write_text("run:\n  name: files\n")
    assert main(["train", str(recipe), *items, "--nproc", "1"]) == 0


def test_lora_run_writes_the_tokenizer_files_into_its_adapter_and_merge_lora_carries_them(setup, tmp_path):
    base, tok = setup["root"] / "base", setup["tok_gen"]
    _train(setup, tmp_path / "run", tok, [f"model.hf_path={base}", "lora.rank=2", "lora.alpha=4.0"])
    adapter = tmp_path / "run" / "final"
    assert (adapter / "adapter_config.json").is_file()
    _same_files(adapter, tok, (*TOKENIZER_FILES, "generation_config.json"))
    _renders_the_template(adapter)
    assert main(["convert", str(adapter), str(tmp_path / "merged"), "--merge-lora"]) == 0
    _same_files(tmp_path / "merged", tok, (*TOKENIZER_FILES, "generation_config.json"))
    _renders_the_template(tmp_path / "merged")
    # an adapter without a generation config (written by another tool) gets its base's
    shutil.copytree(adapter, tmp_path / "bare")
    (tmp_path / "bare" / "generation_config.json").unlink()
    with_gen = setup["root"] / "base-gen"
    assert main(["convert", str(tmp_path / "bare"), str(tmp_path / "merged2"), "--merge-lora",
                 "--base", str(with_gen)]) == 0
    _same_files(tmp_path / "merged2", tok, TOKENIZER_FILES)
    _same_files(tmp_path / "merged2", with_gen, ("generation_config.json",))


def test_full_run_writes_them_into_its_final_dir_and_every_conversion_carries_them(setup, tmp_path):
    """The tokenizer files come from the data's tokenizer, generation_config.json from model.hf_path."""
    base, tok = setup["root"] / "base-gen", setup["tok"]
    _train(setup, tmp_path / "run", tok, [f"model.hf_path={base}", "checkpoint.save_every=2"])
    final = tmp_path / "run" / "final"
    assert (final / "config.json").is_file()
    _same_files(final, tok, TOKENIZER_FILES)
    _same_files(final, base, ("generation_config.json",))
    _renders_the_template(final)
    # the training checkpoint carries them, so plait convert CKPT DEST writes them out
    assert main(["convert", str(tmp_path / "run" / "checkpoints"), str(tmp_path / "hf"), "--no-progress"]) == 0
    _same_files(tmp_path / "hf", tok, TOKENIZER_FILES)
    _same_files(tmp_path / "hf", base, ("generation_config.json",))
    # and back: HF -> plait -> HF keeps them
    assert main(["convert", str(final), str(tmp_path / "ckpt"), "--no-progress"]) == 0
    assert main(["convert", str(tmp_path / "ckpt"), str(tmp_path / "hf2"), "--no-progress"]) == 0
    _same_files(tmp_path / "hf2", tok, TOKENIZER_FILES)
    _same_files(tmp_path / "hf2", base, ("generation_config.json",))


def test_a_changed_chat_template_or_special_token_is_a_new_prepared_directory(setup, tmp_path):
    tok = tmp_path / "tok"
    shutil.copytree(setup["tok"], tok)
    source, settings = setup["paths"]["sft_train"], RowsSettings(kind="sft", seq_len=256, val_fraction=0.1)
    first = prepare_rows(source, tok / "tokenizer.json", settings, cache_dir=tmp_path / "cache")
    assert not first.reused
    _same_files(first.directory, tok, TOKENIZER_FILES)  # kept for the model trained on them
    index = json.loads((first.directory / "index.json").read_text())
    assert index["tokenizer_sha256"] == file_sha256(tok / "tokenizer.json")
    assert prepare_rows(source, tok / "tokenizer.json", settings, cache_dir=tmp_path / "cache").reused
    (tok / "chat_template.jinja").write_text(TEMPLATE.replace(": ", " says: "))
    second = prepare_rows(source, tok / "tokenizer.json", settings, cache_dir=tmp_path / "cache")
    assert not second.reused and second.directory != first.directory
    assert (second.directory / "chat_template.jinja").read_text() == TEMPLATE.replace(": ", " says: ")
    config = json.loads((tok / "tokenizer_config.json").read_text())
    (tok / "tokenizer_config.json").write_text(json.dumps({**config, "eos_token": "<|endoftext|>"}))
    third = prepare_rows(source, tok / "tokenizer.json", settings, cache_dir=tmp_path / "cache")
    assert not third.reused and third.directory not in (first.directory, second.directory)


@pytest.fixture(scope="module")
def other_tokenizer(setup):
    """A tokenizer of the same size as the task's, trained on other text."""
    root = setup["root"]
    text = setup["paths"]["preference_train"].read_text()[::-1]
    other = root / "other"
    other.mkdir()
    chat_tokenizer(text, 320).save(str(other / "tokenizer.json"))
    sizes = {tokenizer_vocab_size(load_tokenizer_file(p)) for p in (root / "tokenizer.json", other / "tokenizer.json")}
    assert sizes == {320}, sizes  # the same vocabulary size
    assert file_sha256(other / "tokenizer.json") != file_sha256(root / "tokenizer.json")
    return other / "tokenizer.json"


def test_rows_used_with_another_tokenizer_of_the_same_size_are_refused_before_launch(setup, other_tokenizer,
                                                                                     tmp_path, capsys):
    source, settings = setup["paths"]["sft_train"], RowsSettings(kind="sft", seq_len=256, val_fraction=0.1)
    rows = prepare_rows(source, setup["tok"] / "tokenizer.json", settings, out_dir=tmp_path / "rows").directory
    items = ["data.format=sft", "train.objective=sft", f"data.source={rows}", f"data.tokenizer={other_tokenizer}",
             "data.seq_len=256", f"run.output_dir={tmp_path / 'run'}", "model.hidden_size=64",
             "model.num_hidden_layers=2", "model.num_attention_heads=4", "model.num_key_value_heads=2",
             "model.intermediate_size=128", "model.max_position_embeddings=256", "parallel.tp=1",
             "parallel.sequence_parallel=false"]
    assert main(["train", *items, "--nproc", "1"]) == 2
    out = capsys.readouterr()
    assert "launching" not in out.out  # refused in the parent, before any rank started
    line = out.err.strip().splitlines()[-1]
    assert str(other_tokenizer) in line and str(rows / "tokenizer.json") in line, line
    assert f"data.tokenizer={rows / 'tokenizer.json'}" in line, line
    # the rows' own tokenizer replaced by that one is refused too
    check_rows_tokenizer(rows, setup["tok"] / "tokenizer.json")
    shutil.copyfile(other_tokenizer, rows / "tokenizer.json")
    with pytest.raises(DataError, match="the file was replaced"):
        check_rows_tokenizer(rows, None)


def test_text_shards_record_their_tokenizer_and_refuse_another_of_the_same_size(setup, other_tokenizer,
                                                                                 tmp_path):
    root = setup["root"]
    text = tmp_path / "text.txt"
    text.write_text(setup["paths"]["sft_train"].read_text().replace("<|endoftext|>", ""))
    data = prepare_dataset(text, tokenizer=str(root / "tokenizer.json"), out_dir=tmp_path / "d", progress=False)
    index = json.loads((data / "index.json").read_text())
    assert index["tokenizer_sha256"] == file_sha256(root / "tokenizer.json")
    verify_prepared(data)
    shutil.copyfile(other_tokenizer, data / "tokenizer.json")
    with pytest.raises(DataError, match="replaced by another of the same size"):
        verify_prepared(data)
