"""Tests that run in the full suite only, each with the fast-tier test that stands for its path.

The fast tier (`pytest -m "not slow"`, tests/conftest.py) has a budget of 5 minutes on a
quiet 2-core machine. These tests took 5 s or more there (`--durations`, stop 42: 490 s
before); each one's path keeps a cheaper test in the fast tier, named on the right.
`conftest.py` marks them `slow`; `tests/test_conftest.py` checks that every name on both
sides is a collected test and that each representative stays fast.
"""

_BN = "tests/test_compat_keras_batch_norm.py::"
_OPT = "tests/test_compat_keras_optimizer.py::"
_TRAIN = "tests/test_train.py::"
_FLAGS = "tests/test_train_flags.py::"
_BACKUP = "tests/test_backup_and_restore.py::"
_TIMER = "tests/test_step_timer.py::test_throughput_lies_between_bounds_from_measured_wall_time"

FULL_RUN_ONLY = {
    # Keras fixes under MirroredStrategy: one scenario per fix stays.
    _BN + "test_mirrored_matches_one_device[nested-2]": _BN + "test_mirrored_matches_one_device[chain-2]",
    _BN + "test_mirrored_matches_one_device[chain-4]": _BN + "test_mirrored_matches_one_device[chain-2]",
    _BN + "test_one_replica_and_replica_statistics_launch_nothing_and_train_as_keras": (
        _BN + "test_stock_keras_differs[chain]"
    ),
    _OPT + "test_backup_mid_accumulation_cycle_resumes_exactly": (
        _OPT + "test_one_replica_mirrored_accumulates_like_one_device[accumulation]"
    ),
    _OPT + "test_mirrored_matches_one_device[accumulation-2]": (
        _OPT + "test_mixed_float16_loss_scaling_matches_one_device[plain]"
    ),
    "tests/test_compat_loss_denominator.py::test_mirrored_matches_one_device[uneven_numpy]": (
        "tests/test_compat_loss_denominator.py::test_mirrored_matches_one_device[timestep_mask]"
    ),
    "tests/test_compat.py::test_steps_per_execution_under_mirrored_trains_and_evaluates_as_one_device[2]": (
        "tests/test_compat.py::test_global_batch_not_divisible_by_replicas_trains_as_one_device"
    ),
    "tests/test_compat_backup.py::test_initial_epoch_attribute_makes_fit_start_there": (
        "tests/test_compat_backup.py::test_fit_internals_count_batches_and_iterators_as_resume_assumes"
    ),
    # Model parallelism: one trained equivalence per mode stays.
    "tests/test_pipeline.py::test_recompute_and_sample_weights_train_like_unsplit_model[None]": (
        "tests/test_pipeline.py::test_recompute_and_sample_weights_train_like_unsplit_model[False]"
    ),
    "tests/test_partition_graph.py::test_layer_split_of_a_graph_trains_like_keras[2-residual]": (
        "tests/test_partition_graph.py::"
        "test_two_inputs_two_outputs_with_loss_weights_and_metrics_per_output[list]"
    ),
    "tests/test_train_model_parallel.py::"
    "test_pipeline_dp2_x_pp2_losses_per_epoch_equal_one_device_with_the_plan_report": (
        "tests/test_train_model_parallel.py::test_model_split_dp2_x_tensor_split_2_equals_one_device"
    ),
    "tests/test_generality.py::test_model_trains_like_the_unsplit_model[convnet_dropout-gpipe]": (
        "tests/test_generality.py::test_model_trains_like_the_unsplit_model[convnet_dropout-1f1b]"
    ),
    "tests/test_hybrid.py::test_pipeline_x_data_parallel_trains_like_one_device[mlp-gpipe]": (
        "tests/test_hybrid.py::test_new_schedules_compose_with_data_parallel[zb-h1-1]"
    ),
    "tests/test_model_split.py::test_tensor_split_weights_go_through_merge_into_the_original": (
        "tests/test_model_split.py::test_layer_split_weights_file_loads_into_the_original_and_back"
    ),
    "tests/test_model_split_keras_equivalence.py::"
    "test_layer_split_data_parallel_averages_a_masked_loss_over_the_batch_valid_steps": (
        "tests/test_model_split_keras_equivalence.py::"
        "test_layer_split_keeps_the_mask_of_a_per_timestep_output_for_the_loss"
    ),
    "tests/test_data_parallel_keras_equivalence.py::"
    "test_backup_resume_with_dropout_equals_the_uninterrupted_run[layer]": (
        "tests/test_data_parallel_keras_equivalence.py::test_dropout_draws_the_one_device_masks[layer]"
    ),
    # Communication, timing: the cheapest case of each stays (ZeRO: FAST_REPRESENTATIVES).
    "tests/test_communication.py::test_bytes_per_pack_splits_the_all_reduce_into_launches": (
        "tests/test_communication.py::test_compression_sends_half_the_bytes[None-float32-1.0]"
    ),
    "tests/test_communication.py::test_compressed_training_loss_within_one_percent[fp16]": (
        "tests/test_communication.py::test_fp16_overflow_falls_back_to_uncompressed_instead_of_inf"
    ),
    _TIMER + "[mirrored-options0-1]": _TIMER + "[one_device-options1-4]",
    # The training binary: the README's one-device run stays.
    _FLAGS + "test_quickstart_example_trains_to_high_accuracy": (
        _FLAGS + "test_one_device_flagfile_trains_the_digits_as_the_readme_says"
    ),
    _TRAIN + "test_no_flags_trains_the_bundled_digits_far_above_chance": (
        _FLAGS + "test_one_device_flagfile_trains_the_digits_as_the_readme_says"
    ),
    _TRAIN + "test_mirrored_matches_one_device_with_the_same_global_batch": (
        "tests/test_strategies.py::test_mirrored_on_cpu_replicas_matches_one_device[2]"
    ),
    _TRAIN + "test_step_timer_reports_throughput_to_logs_and_tensorboard": (
        _TIMER + "[one_device-options1-4]"
    ),
    # Backups: one mid-epoch resume, one torn-backup fallback, one foreign entry stay.
    _BACKUP + "test_resumes_exactly_under_mirrored": _BACKUP + "test_resumes_mid_epoch_exactly[array-1-22]",
    _BACKUP + "test_inconsistent_newest_backup_is_torn_and_falls_back[_keep_some_variables]": (
        _BACKUP + "test_torn_newest_backup_falls_back_to_previous"
    ),
    "tests/test_backup_async.py::test_early_snapshots_resume_mid_epoch_exactly[array-2]": (
        "tests/test_backup_async.py::test_backup_of_the_synchronous_writer_resumes_exactly_with_async"
    ),
    "tests/test_hostile_backup.py::"
    "test_foreign_entries_are_left_alone_and_cost_one_line_at_most[3000 empty ckpt dirs]": (
        "tests/test_hostile_backup.py::test_a_foreign_entry_where_a_backup_goes_is_one_line_and_left_alone"
    ),
    _BACKUP + "test_inconsistent_newest_backup_is_torn_and_falls_back[_state_of_another_model]": (
        _BACKUP + "test_torn_newest_backup_falls_back_to_previous"
    ),
    _BACKUP + "test_resumes_mid_epoch_exactly[tfdata_reshuffle-1-38]": (
        _BACKUP + "test_resumes_mid_epoch_exactly[array-1-22]"
    ),
    _BN + "test_layers_made_before_the_fix_was_applied_take_the_global_batch_too": (
        _BN + "test_mirrored_matches_one_device[chain-2]"
    ),
    _OPT + "test_one_replica_mirrored_accumulates_like_one_device[accumulation_clip]": (
        _OPT + "test_one_replica_mirrored_accumulates_like_one_device[accumulation]"
    ),
}
