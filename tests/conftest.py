import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))

import pytest  # noqa: E402

#: Variants of multi-process tests whose mechanism a test of the default suite already covers
#: (another layout of the same parity check, a second reshard direction, a wider TP degree of the
#: same KV replication). About 7 minutes on 2 cores together: they run with `make test-slow`, so
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
    # covered by the ZeRO-3 cases beside them (TP x DP at ZeRO-3, resume and SIGTERM under ZeRO-3,
    # the TP=2 bitwise deferred build) or by test_lora's TP layouts
    "tests/test_dp_parity.py::test_layout_matches_single_process[tp2xdp2-zero1]",
    "tests/test_checkpoint_resume.py::test_resume_is_bitwise_exact[dp2-zero1]",
    "tests/test_fault_handling.py::test_sigterm_saves_a_checkpoint_exits_cleanly_and_resume_continues_exactly[dp2]",
    "tests/test_sft_training.py::test_lora_sft_trains_only_adapters_and_matches_under_tp_dp",
    # training parity of hybrid sharding and offload under ZeRO-3: the mesh groups, the rules and
    # offload in one process stay in the default suite
    "tests/test_hybrid_sharding.py::test_hybrid_levels_match_zero1_over_every_rank[3]",
    "tests/test_offload.py::test_offload_equals_the_update_on_the_device[dp2-zero3]",
    # PP x DP at ZeRO-3 (the bitwise deferred build from Hugging Face under PP=2 stays), resharding
    # across levels (exact ZeRO-3 resume stays), EP at ZeRO-3 (EP parity in test_moe_*), orpo under
    # PP x DP (preference heads under another layout in test_post_training_resume), head padding
    # and hf_path under PP (test_kv_replication, the deferred Hugging Face build), TP/PP init
    # (test_init_and_model)
    "tests/test_dp_parity.py::test_layout_matches_single_process[pp2xdp2-zero3-tied]",
    "tests/test_checkpoint_resume.py::test_checkpoint_loads_under_another_layout[dp2-zero3-to-dp2-zero1]",
    "tests/test_zero_levels.py::test_level_matches_zero1[expert-parallel]",
    "tests/test_preference_training.py::test_reference_free_objectives_are_the_same_under_pp_dp[orpo-extra0]",
    "tests/test_hf_parity.py::test_tp4_head_padding_matches_transformers_and_round_trips",
    "tests/test_one_path.py::test_hf_path_is_read_under_pipeline_parallelism[layout0-2]",
    "tests/test_materialize.py::test_tp2_pp2_initial_weights_equal_one_process[untied]",
    # the default suite's ten minutes: siblings of each stay (the TP=2 bf16 deferred build, the
    # 2-1-* stage logits, ZeRO levels under LoRA and dp_parity's, the SFT and preference eval rows,
    # the other KV-replication cases, TP=2 -> TP=1 resharding, lm-eval in one process)
    "tests/test_deferred_build.py::test_owned_chunks_equal_those_of_a_whole_build[1-2-fp32-True]",
    "tests/test_one_path.py::test_stages_give_the_full_models_logits_on_every_rank[2-2-1]",
    "tests/test_zero_levels.py::test_level_matches_zero1[bf16-pure]",
    "tests/test_post_training_cli.py::test_eval_scores_grpo_prompt_rows_as_their_sft_twins",
    "tests/test_kv_replication.py::test_kv_replication_matches_dense[8-2-2-adjacent-False-False-2-8]",
    "tests/test_checkpoint_resume.py::test_checkpoint_loads_under_another_layout[pp1-to-pp2-vpp2]",
    "tests/test_lm_eval.py::test_tp2_gives_the_single_process_scores",
    # TP x DP at ZeRO-3 with SP: ZeRO-3 stays in dp2-zero3, TP x DP x SP in test_grpo_training
    "tests/test_dp_parity.py::test_layout_matches_single_process[tp2xdp2-zero3-sp]",
    # peak-memory measurements (seconds of large builds); correctness of the builds stays
    "tests/test_deferred_build.py::test_peak_build_memory_is_the_shard_not_the_local_model",
    "tests/test_materialize.py::test_each_rank_allocates_only_its_shard",
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
