import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))

import pytest  # noqa: E402

#: Variants of multi-process tests whose mechanism a test of the default suite already covers
#: (another layout of the same parity check, a second reshard direction, a wider TP degree of the
#: same KV replication). About 5 minutes on 2 cores together: they run with `make test-slow`, so
#: the default suite stays under 10 minutes here.
SLOW_VARIANTS = frozenset({
    "tests/test_checkpoint_resume.py::test_checkpoint_loads_under_another_layout[tp1-to-tp4-kvrep]",
    "tests/test_checkpoint_resume.py::test_checkpoint_loads_under_another_layout[pp2-to-pp1]",
    "tests/test_checkpoint_resume.py::test_checkpoint_loads_under_another_layout[dp2-zero1-to-dp1]",
    "tests/test_checkpoint_resume.py::test_resume_is_bitwise_exact[pp2]",
    "tests/test_dp_parity.py::test_layout_matches_single_process[pp2xdp2-zero1-tied]",
    "tests/test_dp_parity.py::test_layout_matches_single_process[dp2]",
    "tests/test_pipeline_parity.py::test_pipeline_matches_single_process[pp2xtp2-sp]",
    "tests/test_pipeline_parity.py::test_pipeline_matches_single_process[pp2]",
    "tests/test_trainer_edges.py::test_validation_loss_is_the_same_under_every_layout",
    "tests/test_lora.py::test_tp4_kv_replication_and_head_padding",
    "tests/test_materialize.py::test_tp2_pp2_initial_weights_equal_one_process[tied]",
    "tests/test_loss_parity.py::test_tp_loss_matches_single_process[tp4-kvrep]",
    "tests/test_init_and_model.py::test_initial_weights_identical_for_tp_1_2_4[untied]",
    "tests/test_families.py::test_tp4_kv_replication_matches_transformers",
    "tests/test_kv_replication.py::test_kv_replication_matches_dense[6-2-None-interleaved-True-False-2-8]",
    "tests/test_kv_replication.py::test_kv_replication_matches_dense[6-6-None-interleaved-False-False-1-8]",
    "tests/test_kv_replication.py::test_kv_replication_matches_dense[4-1-None-interleaved-True-True-4-4]",
    "tests/test_kv_replication.py::test_kv_replication_matches_dense[4-2-None-interleaved-False-False-2-4]",
    "tests/test_grad_norm.py::test_grad_norm_matches_single_process[tp4-kvrep4]",
    "tests/test_data_parallel.py::test_buckets_reduce_during_the_last_backward_only[False]",
    "tests/test_trainer.py::test_trainer_layouts_follow_single_process[tp2xdp2-microbatches2]",
    "tests/test_activation_checkpointing.py::test_trainer_checkpointing_is_bitwise_with_dropout_at_tp2",
    "tests/test_sft_training.py::test_sft_loss_is_the_same_under_tp_dp_and_pp_dp[tp2xdp2-sp]",
    "tests/test_preference_training.py::test_dpo_with_a_frozen_reference_is_the_same_under_tp_dp",
})


@pytest.hookimpl(tryfirst=True)  # before `-m 'not slow'` deselects by marker
def pytest_collection_modifyitems(config, items):
    ids = {item.nodeid for item in items}
    functions = {nodeid.split("[")[0] for nodeid in ids}
    for item in items:
        if item.nodeid in SLOW_VARIANTS:
            item.add_marker(pytest.mark.slow)
    # a renamed test or parameter would silently run again by default: name it
    stale = sorted(n for n in SLOW_VARIANTS if n.split("[")[0] in functions and n not in ids)
    if stale:
        raise pytest.UsageError(f"tests/conftest.py SLOW_VARIANTS names tests that no longer exist: {stale[:3]}")
