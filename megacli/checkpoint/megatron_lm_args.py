"""Megatron-LM's run arguments (the ``args`` Namespace in every checkpoint it writes) for a megacli recipe.

``PARSE_ARGS_DEFAULTS`` lists every field Megatron-LM core_v0.16.1's ``parse_args`` defines, with
its default (``benchmarks/megatron_lm_args_check.py CHECKOUT`` compares it with a checkout). A
written ``args`` starts from these, drops what ``validate_args`` deletes, and sets what the recipe
implies through ``FLAGS``: the one table of Megatron-LM argument <-> recipe key (the README's
"Coming from Megatron-LM" table is generated from it), then the fields ``validate_args`` and
training derive (data-parallel size, params dtype, padded vocabulary, iteration, ...).
The reverse direction (args -> recipe) is megacli.checkpoint.legacy_args; tests check that both
agree on every model field.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Any, Callable

from megacli.checkpoint.legacy_args import MEGATRON_ROPE_SCALING
from megacli.errors import UserError

# name -> default of every argument parse_args defines (enum defaults by member name).
PARSE_ARGS_DEFAULTS: dict[str, Any] = {
    'account_for_embedding_in_pipeline_split': False,
    'account_for_loss_in_pipeline_split': False,
    'accumulate_allreduce_grads_in_fp32': False,
    'activation_func_clamp_value': None,
    'adam_beta1': 0.9,
    'adam_beta2': 0.999,
    'adam_eps': 1e-08,
    'add_bias_linear': True,
    'add_position_embedding': True,
    'add_qkv_bias': False,
    'adlr_autoresume': False,
    'adlr_autoresume_interval': 1000,
    'align_grad_reduce': True,
    'align_param_gather': True,
    'allow_ambiguous_pad_tokens': False,
    'app_tag_run_name': None,
    'app_tag_run_version': '0.0.0',
    'apply_query_key_layer_scaling': False,
    'apply_residual_connection_post_layernorm': False,
    'apply_rope_fusion': True,
    'apply_wd_to_qk_layernorm': False,
    'async_save': False,
    'async_tensor_model_parallel_allreduce': True,
    'attention_backend': 'auto',
    'attention_dropout': 0.1,
    'attention_output_gate': False,
    'attention_softmax_in_fp32': False,
    'auto_detect_ckpt_format': False,
    'barrier_with_L1_time': True,
    'batch_invariant_mode': False,
    'batch_size': None,
    'bert_binary_head': True,
    'bert_embedder_type': 'megatron',
    'bert_load': None,
    'bf16': False,
    'bias_dropout_fusion': True,
    'bias_gelu_fusion': True,
    'bias_swiglu_fusion': True,
    'biencoder_projection_dim': 0,
    'biencoder_shared_query_context_model': False,
    'block_data_path': None,
    'cache_mla_latents': False,
    'calc_ft_timeouts': False,
    'calculate_per_token_loss': False,
    'check_for_large_grads': False,
    'check_for_nan_in_loss_and_grad': True,
    'check_for_spiky_loss': False,
    'check_weight_hash_across_dp_replicas_interval': None,
    'checkpoint_activations': False,
    'ckpt_assume_constant_structure': False,
    'ckpt_convert_format': None,
    'ckpt_convert_save': None,
    'ckpt_convert_update_legacy_dist_opt_format': False,
    'ckpt_format': 'torch_dist',
    'ckpt_fully_parallel_load': False,
    'ckpt_fully_parallel_save': True,
    'ckpt_fully_parallel_save_deprecated': False,
    'ckpt_step': None,
    'classes_fraction': 1.0,
    'clip_grad': 1.0,
    'clone_scatter_output_in_embedding': True,
    'config_logger_dir': '',
    'context_parallel_size': 1,
    'cp_comm_type': ['p2p'],
    'cpu_offloading_num_layers': 0,
    'create_all_gather_group': False,
    'create_attention_mask_in_dataloader': True,
    'cross_entropy_fusion_impl': 'native',
    'cross_entropy_loss_fusion': False,
    'cuda_graph_impl': 'none',
    'cuda_graph_scope': [],
    'cuda_graph_warmup_steps': 3,
    'data_args_path': None,
    'data_cache_path': None,
    'data_parallel_random_init': False,
    'data_parallel_sharding_strategy': 'no_shard',
    'data_path': None,
    'data_per_class_fraction': 1.0,
    'data_sharding': True,
    'dataloader_defer_npy_index_mmap': False,
    'dataloader_fast_cache_load': False,
    'dataloader_type': None,
    'ddp_average_in_collective': False,
    'ddp_bucket_size': None,
    'ddp_num_buckets': None,
    'ddp_pad_buckets_for_high_nccl_busbw': False,
    'ddp_reduce_scatter_with_fp32_accumulation': False,
    'decode_only_cuda_graphs': False,
    'decoder_first_pipeline_num_layers': None,
    'decoder_last_pipeline_num_layers': None,
    'decoder_num_layers': None,
    'decoder_seq_length': None,
    'decoupled_lr': None,
    'decoupled_min_lr': None,
    'decrease_batch_size_if_needed': False,
    'defer_embedding_wgrad_compute': False,
    'delay_wgrad_compute': False,
    'deprecated_use_mcore_models': False,
    'deterministic_mode': False,
    'dino_bottleneck_size': 256,
    'dino_freeze_last_layer': 1,
    'dino_head_hidden_size': 2048,
    'dino_local_crops_number': 10,
    'dino_local_img_size': 96,
    'dino_norm_last_layer': False,
    'dino_teacher_temp': 0.07,
    'dino_warmup_teacher_temp': 0.04,
    'dino_warmup_teacher_temp_epochs': 30,
    'disable_bf16_reduced_precision_matmul': False,
    'disable_chunked_prefill': True,
    'disable_jit_fuser': False,
    'disable_straggler_on_startup': False,
    'disable_symmetric_registration': False,
    'dist_ckpt_format_deprecated': None,
    'dist_ckpt_optim_fully_reshardable': False,
    'dist_ckpt_save_pre_mcore_014': False,
    'dist_ckpt_strictness': 'assume_ok_unexpected',
    'distrib_optim_fully_reshardable_mem_efficient': False,
    'distribute_saved_activations': False,
    'distributed_backend': 'nccl',
    'distributed_timeout_minutes': 10,
    'distributed_timeout_seconds_after_init': None,
    'dsa_indexer_head_dim': None,
    'dsa_indexer_loss_coeff': None,
    'dsa_indexer_n_heads': None,
    'dsa_indexer_topk': None,
    'dsa_indexer_use_sparse_loss': False,
    'dump_param_to_param_group_map': None,
    'embedding_init_method_std': None,
    'embedding_path': None,
    'empty_unused_memory_level': 0,
    'enable_cuda_graph': False,
    'enable_experimental': False,
    'enable_ft_package': False,
    'enable_full_sharding_in_hsdp': False,
    'enable_gloo_process_groups': True,
    'enable_msc': True,
    'enable_one_logger': True,
    'encoder_num_layers': None,
    'encoder_seq_length': None,
    'end_weight_decay': None,
    'eod_mask_loss': False,
    'ep_overlap_early_attn_memory_release': False,
    'error_injection_rate': 0,
    'error_injection_type': 'transient_error',
    'eval_interval': None,
    'eval_iters': 100,
    'evidence_data_path': None,
    'exit_duration_in_mins': None,
    'exit_interval': None,
    'exit_on_missing_checkpoint': False,
    'exit_signal': 'SIGTERM',
    'exit_signal_handler': False,
    'exit_signal_handler_for_dataloader': False,
    'exp_avg_dtype': 'fp32',
    'exp_avg_sq_dtype': 'fp32',
    'experimental_attention_variant': None,
    'expert_model_parallel_size': 1,
    'expert_tensor_parallel_size': None,
    'external_cuda_graph': False,
    'fake_process_group': False,
    'ffn_hidden_size': None,
    'fim_data': False,
    'fim_eod_token': '<|endoftext|>',
    'fim_fragment_rate': None,
    'fim_middle_token': '<fim_middle>',
    'fim_no_prefix': None,
    'fim_pad_token': '<fim_pad>',
    'fim_prefix_token': '<fim_prefix>',
    'fim_rate': 0.5,
    'fim_split_sample': None,
    'fim_spm_rate': 0.5,
    'fim_suffix_token': '<fim_suffix>',
    'fine_grained_activation_offloading': False,
    'finetune': False,
    'first_last_layers_bf16': False,
    'flash_decode': False,
    'fp16': False,
    'fp16_lm_cross_entropy': False,
    'fp32_residual_connection': False,
    'fp4': None,
    'fp4_param': False,
    'fp4_quantizer_factory': None,
    'fp4_recipe': 'nvfp4',
    'fp8': None,
    'fp8_amax_compute_algo': 'most_recent',
    'fp8_amax_history_len': 1,
    'fp8_interval': 1,
    'fp8_margin': 0,
    'fp8_param_gather': False,
    'fp8_quantizer_factory': None,
    'fp8_recipe': 'delayed',
    'fp8_wgrad': True,
    'fsdp_double_buffer': False,
    'fsdp_manual_registration': False,
    'ft_num_warmup_iters': 5,
    'full_validation': False,
    'global_batch_size': None,
    'glu_linear_offset': 0.0,
    'grad_reduce_in_bf16': False,
    'gradient_accumulation_fusion': True,
    'gradient_reduce_div_fusion': True,
    'group_query_attention': False,
    'grpo_clamp_eps_lower': 0.01,
    'grpo_clamp_eps_upper': 0.01,
    'grpo_entropy_term_weight': 0.0,
    'grpo_filter_groups_with_same_reward': False,
    'grpo_group_size': 2,
    'grpo_iterations': 2,
    'grpo_kl_beta': 0.001,
    'grpo_prompts_per_step': 32,
    'head_lr_mult': 1.0,
    'heterogeneous_layers_config_encoded_json': None,
    'heterogeneous_layers_config_path': None,
    'hidden_dropout': 0.1,
    'hidden_size': None,
    'hierarchical_context_parallel_sizes': None,
    'high_priority_stream_groups': [],
    'hybrid_attention_ratio': 0.0,
    'hybrid_context_parallel': False,
    'hybrid_mlp_ratio': 0.0,
    'hybrid_override_pattern': None,
    'hysteresis': 2,
    'ict_head_size': None,
    'ict_load': None,
    'img_h': 224,
    'img_w': 224,
    'indexer_batch_size': 128,
    'indexer_log_interval': 1000,
    'inference_batch_times_seqlen_threshold': -1,
    'inference_coordinator_port': 12346,
    'inference_dynamic_batching': False,
    'inference_dynamic_batching_block_size': 256,
    'inference_dynamic_batching_buffer_size_gb': 40.0,
    'inference_dynamic_batching_cuda_graph_max_tokens': 16384,
    'inference_dynamic_batching_cuda_graph_mixed_prefill_count': 16,
    'inference_dynamic_batching_max_requests': None,
    'inference_dynamic_batching_max_tokens': None,
    'inference_dynamic_batching_num_cuda_graphs': 16,
    'inference_dynamic_batching_paused_buffer_size_gb': None,
    'inference_dynamic_batching_track_paused_request_events': False,
    'inference_dynamic_batching_unified_memory_level': 0,
    'inference_fuse_tp_communication': False,
    'inference_logging_step_interval': 0,
    'inference_max_batch_size': 8,
    'inference_max_seq_length': 2560,
    'inference_rng_tracker': False,
    'inference_wandb_logging': False,
    'init_method_std': 0.02,
    'init_method_xavier_uniform': False,
    'init_model_with_meta_device': False,
    'initial_loss_scale': 4294967296,
    'inprocess_active_world_size': 1,
    'inprocess_barrier_timeout': 120,
    'inprocess_completion_timeout': 120,
    'inprocess_empty_cuda_cache': False,
    'inprocess_granularity': 'node',
    'inprocess_hard_timeout': 90,
    'inprocess_heartbeat_interval': 30,
    'inprocess_heartbeat_timeout': 60,
    'inprocess_last_call_wait': 1,
    'inprocess_max_iterations': None,
    'inprocess_monitor_process_interval': 1.0,
    'inprocess_monitor_thread_interval': 1.0,
    'inprocess_progress_watchdog_interval': 1.0,
    'inprocess_restart': False,
    'inprocess_soft_timeout': 60,
    'inprocess_termination_grace_time': 1,
    'is_hybrid_model': False,
    'iter_per_epoch': 1250,
    'iterations_to_skip': [],
    'keep_fp8_transpose_cache': False,
    'kitchen_attention_backend': 'sdpa',
    'kv_channels': None,
    'kv_lora_rank': 32,
    'langrl_env_config': None,
    'langrl_external_server': False,
    'langrl_inference_server_conversation_template': None,
    'langrl_inference_server_type': 'inplace_megatron',
    'layernorm_epsilon': 1e-05,
    'layernorm_zero_centered_gamma': False,
    'lazy_mpu_init': None,
    'legacy_tokenizer': False,
    'linear_attention_freq': None,
    'linear_conv_kernel_dim': 4,
    'linear_key_head_dim': 128,
    'linear_num_key_heads': 16,
    'linear_num_value_heads': 32,
    'linear_value_head_dim': 128,
    'load': None,
    'load_main_params_from_ckpt': False,
    'local_rank': 0,
    'log_device_memory_used': False,
    'log_energy': False,
    'log_interval': 100,
    'log_loss_scale_to_tensorboard': True,
    'log_max_attention_logit': False,
    'log_memory_interval': None,
    'log_memory_to_tensorboard': False,
    'log_num_zeros_in_grad': False,
    'log_params_norm': False,
    'log_progress': False,
    'log_straggler': False,
    'log_throughput': False,
    'log_timers_to_tensorboard': False,
    'log_validation_ppl_to_tensorboard': False,
    'log_world_size_to_tensorboard': False,
    'logging_level': None,
    'loss_scale': None,
    'loss_scale_window': 1000,
    'lr': None,
    'lr_decay_iters': None,
    'lr_decay_samples': None,
    'lr_decay_style': 'linear',
    'lr_warmup_fraction': None,
    'lr_warmup_init': 0.0,
    'lr_warmup_iters': 0,
    'lr_warmup_samples': 0,
    'lr_wsd_decay_iters': None,
    'lr_wsd_decay_samples': None,
    'lr_wsd_decay_style': 'exponential',
    'main_grads_dtype': 'fp32',
    'main_params_dtype': 'fp32',
    'make_vocab_size_divisible_by': 128,
    'mamba_head_dim': 64,
    'mamba_num_groups': 8,
    'mamba_num_heads': None,
    'mamba_state_dim': 128,
    'manual_gc': False,
    'manual_gc_eval': True,
    'manual_gc_interval': 0,
    'mask_factor': 1.0,
    'mask_prob': 0.15,
    'mask_type': 'random',
    'masked_softmax_fusion': True,
    'max_position_embeddings': None,
    'max_seqlen_per_dp_cp_rank': None,
    'max_tokens_to_oom': 12000,
    'memory_snapshot_path': 'snapshot.pickle',
    'merge_file': None,
    'micro_batch_size': None,
    'microbatch_group_size_per_vp_stage': None,
    'mid_level_dataset_surplus': 0.005,
    'min_loss_scale': 1.0,
    'min_lr': 0.0,
    'min_offloaded_tensor_size': 1048576,
    'mlp_chunks_for_prefill': 1,
    'mmap_bin_files': True,
    'mock_data': False,
    'model_parallel_size': None,
    'moe_apply_probs_on_input': False,
    'moe_aux_loss_coeff': 0.0,
    'moe_deepep_num_sms': 20,
    'moe_enable_deepep': False,
    'moe_enable_routing_replay': False,
    'moe_expert_capacity_factor': None,
    'moe_extended_tp': False,
    'moe_ffn_hidden_size': None,
    'moe_flex_dispatcher_backend': 'deepep',
    'moe_grouped_gemm': False,
    'moe_hybridep_num_sms': 16,
    'moe_input_jitter_eps': None,
    'moe_latent_size': None,
    'moe_layer_freq': 1,
    'moe_layer_recompute': False,
    'moe_pad_expert_input_to_capacity': False,
    'moe_pad_experts_for_cuda_graph_inference': False,
    'moe_per_layer_logging': False,
    'moe_permute_fusion': False,
    'moe_router_bias_update_rate': 0.001,
    'moe_router_dtype': None,
    'moe_router_enable_expert_bias': False,
    'moe_router_force_load_balancing': False,
    'moe_router_fusion': False,
    'moe_router_group_topk': None,
    'moe_router_load_balancing_type': 'aux_loss',
    'moe_router_num_groups': None,
    'moe_router_padding_for_fp8': False,
    'moe_router_padding_for_quantization': False,
    'moe_router_pre_softmax': False,
    'moe_router_score_function': 'softmax',
    'moe_router_topk': 2,
    'moe_router_topk_scaling_factor': None,
    'moe_shared_expert_gate': False,
    'moe_shared_expert_intermediate_size': None,
    'moe_shared_expert_overlap': False,
    'moe_token_dispatcher_type': 'allgather',
    'moe_token_drop_policy': 'probs',
    'moe_upcycling_granularity': 1,
    'moe_use_legacy_grouped_gemm': False,
    'moe_use_upcycling': False,
    'moe_z_loss_coeff': None,
    'mrope_section': None,
    'mscale': 1.0,
    'mscale_all_dim': 0.0,
    'mtp_loss_scaling_factor': 0.1,
    'mtp_num_layers': None,
    'mtp_standalone': False,
    'multi_latent_attention': False,
    'multiple_validation_sets': False,
    'muon_extra_scale_factor': 1.0,
    'muon_fp32_matmul_prec': 'medium',
    'muon_momentum': 0.9,
    'muon_num_ns_steps': 5,
    'muon_scale_mode': 'spectral',
    'muon_split_qkv': True,
    'muon_tp_mode': 'blockwise',
    'muon_use_nesterov': False,
    'nccl_all_reduce_for_prefill': False,
    'nccl_communicator_config_path': None,
    'nccl_ub': False,
    'no_load_optim': None,
    'no_load_rng': None,
    'no_persist_layer_norm': False,
    'no_rope_freq': None,
    'no_save_optim': None,
    'no_save_rng': None,
    'no_weight_decay_cond_type': None,
    'non_persistent_ckpt_type': None,
    'non_persistent_global_ckpt_dir': None,
    'non_persistent_local_ckpt_algo': 'fully_parallel',
    'non_persistent_local_ckpt_dir': None,
    'non_persistent_save_interval': None,
    'normalization': 'LayerNorm',
    'num_attention_heads': None,
    'num_channels': 3,
    'num_classes': 1000,
    'num_dataset_builder_threads': 1,
    'num_distributed_optimizer_instances': 1,
    'num_experts': None,
    'num_layers': None,
    'num_layers_at_end_in_bf16': 1,
    'num_layers_at_start_in_bf16': 1,
    'num_layers_per_virtual_pipeline_stage': None,
    'num_query_groups': 1,
    'num_virtual_stages_per_pipeline_rank': None,
    'num_workers': 2,
    'object_storage_cache_path': None,
    'offload_modules': [],
    'one_logger_async': False,
    'one_logger_project': 'megatron-lm',
    'one_logger_run_name': None,
    'onnx_safe': None,
    'openai_gelu': False,
    'optimizer': 'adam',
    'optimizer_cpu_offload': False,
    'optimizer_offload_fraction': 1.0,
    'outer_dp_sharding_strategy': 'no_shard',
    'output_bert_embeddings': False,
    'overlap_cpu_optimizer_d2h_h2d': False,
    'overlap_grad_reduce': False,
    'overlap_moe_expert_parallel_comm': False,
    'overlap_p2p_comm': True,
    'overlap_p2p_comm_warmup_flush': False,
    'overlap_param_gather': False,
    'overlap_param_gather_with_optimizer_step': False,
    'override_opt_param_scheduler': False,
    'padded_vocab_size': None,
    'patch_dim': 16,
    'per_dataset_sequences_path': None,
    'per_split_data_args_path': None,
    'perform_initialization': True,
    'perform_rl_step': False,
    'phase_transition_iterations': None,
    'pin_cpu_grads': True,
    'pin_cpu_params': True,
    'pipeline_model_parallel_comm_backend': None,
    'pipeline_model_parallel_layout': None,
    'pipeline_model_parallel_size': 1,
    'position_embedding_type': 'learned_absolute',
    'pretrained_checkpoint': None,
    'profile': False,
    'profile_ranks': [0],
    'profile_step_end': 12,
    'profile_step_start': 10,
    'q_lora_rank': None,
    'qk_clip': False,
    'qk_clip_alpha': 0.5,
    'qk_clip_threshold': 100,
    'qk_head_dim': 128,
    'qk_l2_norm': False,
    'qk_layernorm': False,
    'qk_pos_emb_head_dim': 64,
    'query_in_block_prob': 0.1,
    'quick_geglu': False,
    'rampup_batch_size': None,
    'rank': 0,
    'recompute_activations': False,
    'recompute_granularity': None,
    'recompute_method': None,
    'recompute_modules': None,
    'recompute_num_layers': None,
    'record_memory_history': False,
    'refit_method': 'gloo',
    'relative_attention_max_distance': 128,
    'relative_attention_num_buckets': 32,
    'replication': False,
    'replication_factor': 2,
    'replication_jump': None,
    'rerun_mode': 'validate_results',
    'reset_attention_mask': False,
    'reset_position_ids': False,
    'result_rejected_tracker_filename': None,
    'retriever_report_topk_accuracies': [],
    'retriever_score_scaling': False,
    'reuse_grad_buf_for_mxfp8_param_ag': False,
    'rl_default_temperature': 1.0,
    'rl_default_top_k': -1,
    'rl_default_top_p': 0,
    'rl_importance_sampling_truncation_coef': None,
    'rl_inference_expert_model_parallel_size': None,
    'rl_inference_expert_tensor_model_parallel_size': None,
    'rl_inference_logprobs_is_correction': False,
    'rl_inference_model_unified_memory_level': 0,
    'rl_inference_pipeline_model_parallel_size': None,
    'rl_inference_tensor_model_parallel_size': None,
    'rl_offload_inference_model_weights_when_idle': False,
    'rl_offload_kv_cache_during_training': False,
    'rl_offload_optimizer_during_inference': False,
    'rl_parallel_generation_tasks': 512,
    'rl_partial_rollouts': False,
    'rl_prompts_per_eval': 32,
    'rl_remove_kv_cache_during_training': False,
    'rl_reset_cuda_graphs': False,
    'rl_sequence_packing_algo': 'fifo',
    'rl_sequence_packing_max_sequences_per_bin': 50,
    'rl_skip_bos_token': False,
    'rl_training_cuda_graphs': False,
    'rl_use_sequence_packing': False,
    'rl_verify_model_weights_swap': False,
    'rope_scaling_factor': 8.0,
    'rope_type': None,
    'rotary_base': 10000,
    'rotary_interleaved': False,
    'rotary_percent': 1.0,
    'rotary_scaling_factor': 1.0,
    'rotary_seq_len_interpolation_factor': None,
    'run_workload_inspector_server': False,
    'sample_rate': 1.0,
    'save': None,
    'save_dgrads_interval': None,
    'save_interval': None,
    'save_retain_interval': None,
    'save_wgrads_interval': None,
    'scatter_gather_tensors_in_pipeline': True,
    'seed': 1234,
    'seq_length': None,
    'sequence_parallel': False,
    'sft': False,
    'sft_tokenizer_prompt_format': 'nemotron-h-aligned',
    'sgd_momentum': 0.9,
    'sharp_enabled_group': None,
    'short_seq_prob': 0.1,
    'skip_train': False,
    'softmax_type': 'vanilla',
    'spec': None,
    'split': None,
    'squared_relu': False,
    'start_weight_decay': None,
    'straggler_ctrlr_port': 65535,
    'straggler_minmax_count': 1,
    'strict_fsdp_dtensor_load': True,
    'suggested_communication_unit_size': None,
    'swiglu': False,
    'swin_backbone_type': 'tiny',
    'symmetric_ar_type': None,
    'te_precision_config_file': None,
    'te_rng_tracker': False,
    'tensor_model_parallel_size': 1,
    'tensorboard_dir': None,
    'tensorboard_log_interval': 1,
    'tensorboard_queue_size': 1000,
    'test_data_path': None,
    'test_mode': False,
    'tiktoken_num_special_tokens': 1000,
    'tiktoken_pattern': None,
    'tiktoken_special_tokens': None,
    'timing_log_level': 0,
    'timing_log_option': 'minmax',
    'titles_data_path': None,
    'tokenizer_hf_include_special_tokens': False,
    'tokenizer_hf_use_fast': False,
    'tokenizer_metadata': None,
    'tokenizer_model': None,
    'tokenizer_sentencepiece_legacy': False,
    'tokenizer_special_tokens': None,
    'tokenizer_type': None,
    'torch_fsdp2_reshard_after_forward': True,
    'tp_comm_bootstrap_backend': 'nccl',
    'tp_comm_bulk_dgrad': True,
    'tp_comm_bulk_wgrad': True,
    'tp_comm_overlap': False,
    'tp_comm_overlap_ag': True,
    'tp_comm_overlap_cfg': None,
    'tp_comm_overlap_rs': True,
    'tp_comm_overlap_rs_dgrad': False,
    'tp_comm_split_ag': True,
    'tp_comm_split_rs': True,
    'train_data_path': None,
    'train_iters': None,
    'train_samples': None,
    'train_sync_interval': None,
    'transformer_impl': 'transformer_engine',
    'trust_remote_code': False,
    'untie_embeddings_and_output_weights': False,
    'use_checkpoint_args': False,
    'use_checkpoint_opt_param_scheduler': False,
    'use_cpu_initialization': None,
    'use_dist_ckpt_deprecated': False,
    'use_distributed_optimizer': False,
    'use_flash_attn': False,
    'use_fused_weighted_squared_relu': False,
    'use_kitchen_attention': False,
    'use_legacy_models': False,
    'use_legacy_static_engine': False,
    'use_mamba_mem_eff_path': True,
    'use_megatron_fsdp': False,
    'use_mp_args_from_checkpoint_args': False,
    'use_one_sent_docs': False,
    'use_persistent_ckpt_worker': False,
    'use_precision_aware_optimizer': False,
    'use_pytorch_profiler': False,
    'use_ring_exchange_p2p': False,
    'use_rope_scaling': False,
    'use_rotary_position_embeddings': False,
    'use_sharp': False,
    'use_te_activation_func': False,
    'use_tokenizer_model_from_checkpoint_args': True,
    'use_torch_fsdp2': False,
    'use_torch_optimizer_for_cpu_offload': False,
    'use_tp_pp_dp_mapping': False,
    'v_head_dim': 128,
    'valid_data_path': None,
    'vision_backbone_type': 'vit',
    'vision_pretraining': False,
    'vision_pretraining_type': 'classify',
    'vocab_extra_ids': 0,
    'vocab_file': None,
    'vocab_size': None,
    'wandb_entity': None,
    'wandb_exp_name': None,
    'wandb_project': None,
    'wandb_save_dir': None,
    'warmup': None,
    'weight_decay': 0.01,
    'weight_decay_incr_style': 'constant',
    'wgrad_deferral_limit': 0,
    'window_attn_skip_freq': None,
    'window_size': None,
    'world_size': 1,
    'yaml_cfg': None,
}

# Deprecated spellings validate_args deletes from the Namespace.
DROPPED_BY_VALIDATION = ("batch_size", "warmup", "model_parallel_size", "checkpoint_activations", "recompute_activations")
# Fields validate_args converts from a precision name to a torch dtype.
_DTYPE_FIELDS = ("main_grads_dtype", "main_params_dtype", "exp_avg_dtype", "exp_avg_sq_dtype")
# Fields validate_args and Megatron-LM's training add to the Namespace (set by megatron_args below).
DERIVED = ("consumed_train_samples", "consumed_valid_samples", "skipped_train_samples", "data_parallel_size",
           "params_dtype", "transformer_pipeline_model_parallel_size", "use_dist_ckpt", "variable_seq_lengths",
           "virtual_pipeline_model_parallel_size", "padded_vocab_size", "iteration", "curr_iteration",
           "num_floating_point_operations_so_far", "model_type", "do_train", "do_valid", "do_test")

_POSITIONS = {"learned": "learned_absolute", "rope": "rope", "none": "none", "relative": "relative"}
_DECAY = {"wsd": "WSD"}
_TOKENIZERS = {"huggingface": "HuggingFaceTokenizer", "sentencepiece": "GPTSentencePieceTokenizer",
               "wordpiece": "BertWordPieceLowerCase", "none": "NullTokenizer"}


@dataclass(frozen=True)
class Flag:
    """One Megatron-LM argument and the recipe key it corresponds to: ``value(recipe)`` is the
    argument's value for a validated recipe."""

    arg: str
    key: str
    value: Callable[[Any], Any]
    cli: str | None = None
    """The command-line option where its name is not the field's (``--apply-layernorm-1p``), or
    the environment variable parse_args reads the field from (``WORLD_SIZE``)."""
    off: bool = False
    """The option stores False (``--disable-bias-linear``: the field is True unless it is given)."""

    @property
    def option(self) -> str:
        """The command-line spelling (``--num-layers``), or the environment variable."""
        return self.cli or "--" + self.arg.replace("_", "-")

    @property
    def from_environment(self) -> bool:
        return not self.option.startswith("--")

    def readme(self) -> str:
        """The README's cell: ``--disable-bias-linear`` (off), ``WORLD_SIZE`` (environment)."""
        if self.from_environment:
            return f"`{self.option}` (environment: nodes × processes per node, set by torchrun)"
        return f"`{self.option}` (off)" if self.off else f"`{self.option}`"


def _m(field):
    return lambda r: getattr(r.model, field)


def _moe(arg: str, value: Callable[[Any], Any]) -> Callable[[Any], Any]:
    """A MoE argument: ``value(recipe)`` for a model with model.moe, parse_args' default for a dense one."""
    return lambda r: value(r) if r.model.moe is not None else PARSE_ARGS_DEFAULTS[arg]


def _t5(arg: str, value: Callable[[Any], Any]) -> Callable[[Any], Any]:
    """A T5 argument: ``value(recipe)`` for model.arch t5, parse_args' default for other models."""
    return lambda r: value(r) if r.model.arch == "t5" else PARSE_ARGS_DEFAULTS[arg]


def _e(arg: str, field: str) -> Flag:
    """A MoE argument that is model.moe's ``field`` as it is."""
    return Flag(arg, f"model.moe.{field}", _moe(arg, lambda r: getattr(r.model.moe, field)))


def moe_layer_freq(recipe) -> list[int]:
    """--moe-layer-freq as the one-per-layer pattern, also for an integer model.moe.layer_freq:
    megacli's MoE models store each layer under its own key, which is Megatron-Core's layout for a
    pattern list (an integer giving all MoE layers stacks them under one key)."""
    return recipe.model.moe_layers()


FLAGS: tuple[Flag, ...] = (
    # model
    Flag("num_layers", "model.num_layers", _m("num_layers")),
    Flag("hidden_size", "model.hidden_size", _m("hidden_size")),
    Flag("num_attention_heads", "model.num_attention_heads", _m("num_attention_heads")),
    Flag("group_query_attention", "model.num_query_groups", lambda r: r.model.query_groups != r.model.num_attention_heads),
    Flag("num_query_groups", "model.num_query_groups", lambda r: r.model.query_groups),
    Flag("kv_channels", "model.kv_channels", lambda r: r.model.head_dim),
    Flag("ffn_hidden_size", "model.ffn_hidden_size", lambda r: r.model.ffn_size),
    Flag("seq_length", "model.seq_length", _m("seq_length")),
    Flag("max_position_embeddings", "model.max_position_embeddings", lambda r: r.model.max_positions),
    Flag("position_embedding_type", "model.position_embedding", lambda r: _POSITIONS[r.model.position_embedding]),
    Flag("add_position_embedding", "model.position_embedding", lambda r: r.model.position_embedding != "none",
         cli="--no-position-embedding", off=True),
    Flag("rotary_base", "model.rotary_base", lambda r: int(r.model.rotary_base) if float(r.model.rotary_base).is_integer()
         else r.model.rotary_base),
    Flag("rotary_percent", "model.rotary_percent", _m("rotary_percent")),
    Flag("normalization", "model.normalization", lambda r: "RMSNorm" if r.model.normalization == "rmsnorm" else "LayerNorm"),
    Flag("layernorm_epsilon", "model.norm_epsilon", _m("norm_epsilon"), cli="--norm-epsilon"),
    Flag("swiglu", "model.activation", lambda r: r.model.activation == "swiglu"),
    Flag("squared_relu", "model.activation", lambda r: r.model.activation == "squared_relu"),
    Flag("openai_gelu", "model.activation", lambda r: r.model.activation == "gelu_tanh"),
    Flag("add_bias_linear", "model.add_bias_linear", _m("add_bias_linear"), cli="--disable-bias-linear", off=True),
    Flag("add_qkv_bias", "model.add_qkv_bias", lambda r: r.model.add_qkv_bias or r.model.add_bias_linear),
    # Megatron-Core's fused bias-GeLU is the tanh approximation (and refuses other activations): on for
    # gelu_tanh with biases only (validate_args turns it off without biases)
    Flag("bias_gelu_fusion", "model.activation", lambda r: r.model.activation == "gelu_tanh" and r.model.add_bias_linear,
         cli="--no-bias-gelu-fusion", off=True),
    Flag("qk_layernorm", "model.qk_layernorm", _m("qk_layernorm")),
    Flag("layernorm_zero_centered_gamma", "model.norm_zero_centered_gamma", _m("norm_zero_centered_gamma"),
         cli="--apply-layernorm-1p"),
    Flag("use_rope_scaling", "model.rope_scaling", lambda r: r.model.rope_scaling is not None),
    Flag("rope_scaling_factor", "model.rope_scaling.factor", lambda r: MEGATRON_ROPE_SCALING["factor"]),
    # HF's window w (token i sees i-w+1..i) is Megatron's (w - 1, 0); the same skip-frequency rule
    Flag("window_size", "model.sliding_window",
         lambda r: None if r.model.sliding_window is None else (r.model.sliding_window - 1, 0)),
    Flag("window_attn_skip_freq", "model.sliding_window_layers", _m("sliding_window_layers")),
    Flag("untie_embeddings_and_output_weights", "model.untie_embeddings", _m("untie_embeddings")),
    Flag("hidden_dropout", "model.dropout", _m("dropout")),
    Flag("attention_dropout", "model.attention_dropout", _m("attention_dropout")),
    Flag("init_method_std", "model.init_method_std", _m("init_method_std")),
    Flag("vocab_size", "model.vocab_size", _m("vocab_size")),
    Flag("make_vocab_size_divisible_by", "model.make_vocab_size_divisible_by", _m("make_vocab_size_divisible_by")),
    Flag("bert_binary_head", "model.bert_binary_head", _m("bert_binary_head"), cli="--bert-no-binary-head", off=True),
    # T5 (pretrain_t5.py; validate_args makes --num-layers / --seq-length the encoder's)
    Flag("decoder_num_layers", "model.decoder_num_layers", _t5("decoder_num_layers", lambda r: r.model.dec_num_layers)),
    Flag("decoder_seq_length", "model.decoder_seq_length", _t5("decoder_seq_length", lambda r: r.model.dec_seq_length)),
    Flag("vocab_extra_ids", "masking.sentinel_tokens", _t5("vocab_extra_ids", lambda r: r.masking.sentinel_tokens)),
    # mixture of experts
    _e("num_experts", "num_experts"),
    _e("moe_router_topk", "router_topk"),
    Flag("moe_ffn_hidden_size", "model.moe.ffn_hidden_size", _moe("moe_ffn_hidden_size", lambda r: r.model.expert_ffn_size)),
    Flag("moe_layer_freq", "model.moe.layer_freq", _moe("moe_layer_freq", moe_layer_freq)),
    Flag("moe_router_load_balancing_type", "model.moe.aux_loss_coeff",
         _moe("moe_router_load_balancing_type", lambda r: "aux_loss" if r.model.moe.aux_loss_coeff > 0 else "none")),
    _e("moe_aux_loss_coeff", "aux_loss_coeff"),
    _e("moe_expert_capacity_factor", "capacity_factor"),
    _e("moe_token_drop_policy", "drop_policy"),
    _e("moe_pad_expert_input_to_capacity", "pad_to_capacity"),
    _e("moe_shared_expert_intermediate_size", "shared_expert_ffn_hidden_size"),
    _e("moe_shared_expert_gate", "shared_expert_gate"),
    _e("moe_router_dtype", "router_dtype"),
    _e("moe_router_pre_softmax", "router_pre_softmax"),
    _e("moe_token_dispatcher_type", "dispatcher"),
    _e("moe_grouped_gemm", "grouped_gemm"),
    _e("moe_router_score_function", "router_score_function"),
    _e("moe_router_enable_expert_bias", "router_expert_bias"),
    _e("moe_router_bias_update_rate", "router_bias_update_rate"),
    _e("moe_router_num_groups", "router_num_groups"),
    _e("moe_router_group_topk", "router_group_topk"),
    _e("moe_router_topk_scaling_factor", "router_topk_scaling_factor"),
    # parallel layout
    Flag("tensor_model_parallel_size", "parallel.tensor", lambda r: r.parallel.tensor),
    Flag("pipeline_model_parallel_size", "parallel.pipeline", lambda r: r.parallel.pipeline),
    Flag("num_virtual_stages_per_pipeline_rank", "parallel.virtual_pipeline", lambda r: r.parallel.virtual_pipeline),
    Flag("decoder_first_pipeline_num_layers", "parallel.first_stage_layers", lambda r: r.parallel.first_stage_layers),
    Flag("decoder_last_pipeline_num_layers", "parallel.last_stage_layers", lambda r: r.parallel.last_stage_layers),
    Flag("sequence_parallel", "parallel.sequence_parallel", lambda r: r.parallel.sp_enabled),
    Flag("context_parallel_size", "parallel.context", lambda r: r.parallel.context),
    Flag("expert_model_parallel_size", "parallel.expert", lambda r: r.parallel.expert),
    Flag("expert_tensor_parallel_size", "parallel.expert_tensor", lambda r: r.parallel.expert_tensor or r.parallel.tensor),
    Flag("use_distributed_optimizer", "parallel.distributed_optimizer", lambda r: r.parallel.distributed_optimizer),
    Flag("recompute_granularity", "parallel.recompute", lambda r: None if r.parallel.recompute == "none" else r.parallel.recompute),
    Flag("recompute_method", "parallel.recompute", lambda r: "uniform" if r.parallel.recompute == "full" else None),
    Flag("recompute_num_layers", "parallel.recompute_num_layers",
         lambda r: r.parallel.recompute_num_layers if r.parallel.recompute == "full" else None),
    Flag("overlap_grad_reduce", "parallel.overlap_grad_reduce", lambda r: r.parallel.overlap_grad_reduce),
    Flag("overlap_param_gather", "parallel.overlap_param_gather", lambda r: r.parallel.overlap_param_gather),
    Flag("world_size", "launch.nproc", lambda r: r.world_size, cli="WORLD_SIZE"),
    # training
    Flag("micro_batch_size", "train.micro_batch_size", lambda r: r.train.micro_batch_size),
    Flag("global_batch_size", "train.global_batch_size", lambda r: r.train.global_batch_size),
    Flag("train_iters", "train.iters", lambda r: r.train.iters),
    Flag("seed", "train.seed", lambda r: r.train.seed),
    Flag("eval_interval", "train.eval_interval", lambda r: r.train.eval_interval),
    Flag("eval_iters", "train.eval_iters", lambda r: r.train.eval_iters),
    Flag("log_interval", "train.log_interval", lambda r: r.train.log_interval),
    Flag("bf16", "train.precision", lambda r: r.train.precision == "bf16"),
    Flag("fp16", "train.precision", lambda r: r.train.precision == "fp16"),
    Flag("exit_interval", "train.exit_after_iters", lambda r: r.train.exit_after_iters),
    Flag("exit_duration_in_mins", "train.time_limit_minutes",
         lambda r: None if r.train.time_limit_minutes is None else int(r.train.time_limit_minutes)),
    Flag("deterministic_mode", "train.deterministic", lambda r: r.train.deterministic),
    # optimizer and schedule
    Flag("optimizer", "optim.optimizer", lambda r: r.optim.optimizer),
    Flag("lr", "optim.lr", lambda r: r.optim.lr),
    Flag("min_lr", "optim.min_lr", lambda r: r.optim.min_lr),
    Flag("lr_warmup_iters", "optim.warmup_iters", lambda r: r.optim.warmup_steps(r.train.iters)),
    Flag("lr_decay_style", "optim.decay_style", lambda r: _DECAY.get(r.optim.decay_style, r.optim.decay_style)),
    Flag("lr_decay_iters", "optim.decay_iters", lambda r: r.optim.decay_horizon(r.train.iters)),
    Flag("lr_wsd_decay_iters", "optim.wsd_decay_iters", lambda r: r.optim.wsd_decay_iters),
    Flag("weight_decay", "optim.weight_decay", lambda r: r.optim.weight_decay),
    Flag("start_weight_decay", "optim.weight_decay", lambda r: r.optim.weight_decay),
    Flag("end_weight_decay", "optim.weight_decay", lambda r: r.optim.weight_decay),
    Flag("clip_grad", "optim.clip_grad", lambda r: r.optim.clip_grad),
    Flag("adam_beta1", "optim.adam_beta1", lambda r: r.optim.adam_beta1),
    Flag("adam_beta2", "optim.adam_beta2", lambda r: r.optim.adam_beta2),
    Flag("adam_eps", "optim.adam_eps", lambda r: r.optim.adam_eps),
    Flag("initial_loss_scale", "optim.initial_loss_scale", lambda r: r.optim.initial_loss_scale),
    # tokenizer and data
    Flag("tokenizer_type", "tokenizer.type", lambda r: _TOKENIZERS.get(r.tokenizer.type, "NullTokenizer")),
    Flag("tokenizer_model", "tokenizer.path",
         lambda r: r.tokenizer.path if r.tokenizer.type in ("huggingface", "sentencepiece") else None),
    Flag("vocab_file", "tokenizer.path", lambda r: r.tokenizer.path if r.tokenizer.type == "wordpiece" else None),
    Flag("data_path", "data.path", lambda r: _data_path(r.data)),
    Flag("split", "data.split", lambda r: r.data.split),
    Flag("mock_data", "data.mock", lambda r: bool(r.data.mock)),
    Flag("reset_position_ids", "data.reset_position_ids", lambda r: r.data.reset_position_ids),
    Flag("reset_attention_mask", "data.reset_attention_mask", lambda r: r.data.reset_attention_mask),
    Flag("eod_mask_loss", "data.eod_mask_loss", lambda r: r.data.eod_mask_loss),
    # checkpoints
    Flag("save_interval", "checkpoint.save_interval", lambda r: r.checkpoint.save_interval),
)


def _data_path(data) -> list[str] | None:
    if data.mock:
        return None
    if data.blend:
        return [str(x) for pair in data.blend for x in pair]
    return [str(data.path)] if data.path else None


def _enum_defaults() -> dict[str, Any]:
    import signal

    from megatron.core.transformer.enums import AttnBackend

    return {"attention_backend": AttnBackend[PARSE_ARGS_DEFAULTS["attention_backend"]],
            "exit_signal": signal.Signals[PARSE_ARGS_DEFAULTS["exit_signal"]]}


# Model fields Megatron-LM core_v0.16.1's arguments cannot set: name -> (the value they imply, why).
_NO_ARGUMENT = {
    "softmax_scale": (None, "TransformerConfig.softmax_scale has no command-line argument"),
    "qk_norm_scope": ("head", "--qk-layernorm normalises each head; no argument normalises whole projections"),
    "norm_placement": ("pre", "Megatron-LM's GPT layers are pre-norm; no argument adds norms on sublayer outputs"),
    "attention_softcap": (None, "no argument soft-caps attention scores"),
    "final_logit_softcap": (None, "no argument soft-caps the output logits"),
    "scale_embeddings": (False, "no argument scales the input embeddings"),
    "rotary_base_local": (None, "one RoPE base (--rotary-base) serves every layer"),
    "mla": (None, "multi-latent attention is not mapped: Megatron-LM's local spec names its latent norms "
                  "q_layernorm / kv_layernorm (megacli stores the Transformer Engine spec's linear_q_up_proj / "
                  "linear_kv_up_proj.layer_norm_weight), and its yarn RoPE takes original_max_position_embeddings, "
                  "beta_fast and beta_slow from defaults no argument sets"),
}


def _scaling(s) -> dict:
    return {k: v for k, v in s.model_dump().items() if v is not None}


def unsupported(recipe) -> list[str]:
    """What of the recipe's model Megatron-LM's GPT arguments cannot express (empty when all can)."""
    m = recipe.model
    out = []
    if m.arch not in ("gpt", "t5"):
        out.append(f"model.arch {m.arch} (the Megatron-LM export writes GPT models and T5 ones)")
    if m.arch == "t5":
        if m.dec_num_layers != m.num_layers:
            out.append(f"model.decoder_num_layers {m.dec_num_layers} (pretrain_t5.py builds the decoder with "
                       f"--num-layers layers, here {m.num_layers}: --decoder-num-layers is not passed to the model)")
        if m.scale_decoder_output:
            out.append("model.scale_decoder_output (Megatron-Core's T5Model does not scale the decoder output)")
        if m.qk_layernorm:
            out.append("model.qk_layernorm (Megatron-LM's T5 layer specs have no query/key norms)")
    if m.position_embedding not in _POSITIONS:
        out.append(f"model.position_embedding {m.position_embedding} (Megatron-LM has no such --position-embedding-type)")
    elif m.position_embedding == "relative" and m.arch != "t5":
        out.append("model.position_embedding relative (Megatron-LM builds relative positions for T5 only)")
    if m.activation not in ("gelu", "gelu_tanh", "swiglu", "squared_relu"):
        out.append(f"model.activation {m.activation} (Megatron-LM has no flag for it)")
    elif m.activation == "gelu_tanh" and not m.add_bias_linear:
        out.append("model.activation gelu_tanh without model.add_bias_linear (Megatron-Core computes the tanh "
                   "approximation only in its fused bias-GeLU, with biases; --openai-gelu does not reach its models)")
    if m.rope_scaling is not None and _scaling(m.rope_scaling) != MEGATRON_ROPE_SCALING:
        out.append(f"model.rope_scaling {_scaling(m.rope_scaling)} (Megatron-LM's --use-rope-scaling is Llama 3.1's "
                   f"scaling with fixed parameters, {MEGATRON_ROPE_SCALING}: pretrain_gpt.py does not pass "
                   f"--rope-scaling-factor to the model)")
    out += [f"model.{name} ({why})" for name, (plain, why) in _NO_ARGUMENT.items() if getattr(m, name) != plain]
    if recipe.lora is not None:
        out.append("lora (merge the adapters first: megacli convert CKPT DST --to megacli)")
    return out


def megatron_args(recipe, *, ckpt_format: str = "torch_dist", iteration: int = 0, consumed_samples: int = 0,
                  padded_vocab_size: int | None = None, num_floating_point_operations: int = 0,
                  transformer_impl: str = "transformer_engine", vocab_size: int | None = None) -> argparse.Namespace:
    """The ``args`` Megatron-LM core_v0.16.1 would hold after ``parse_args`` + ``validate_args`` and
    ``iteration`` steps of training this (validated) recipe: every field it defines, the recipe's
    values where it implies them, the defaults elsewhere. ``transformer_impl``: the layer spec the
    weights are named for (transformer_engine or local); ``vocab_size``: the real vocabulary when
    model.vocab_size leaves it to the tokenizer (default: the recipe tokenizer's, when it loads)."""
    import torch

    from megatron.core.enums import ModelType

    problems = unsupported(recipe)
    if problems:
        raise UserError("cannot write Megatron-LM arguments for " + "; ".join(problems))
    fields = dict(PARSE_ARGS_DEFAULTS)
    fields.update(_enum_defaults())
    for name in DROPPED_BY_VALIDATION:
        fields.pop(name, None)
    for flag in FLAGS:
        fields[flag.arg] = flag.value(recipe)
    if fields["vocab_size"] is None:
        fields["vocab_size"] = vocab_size if vocab_size is not None else _tokenizer_vocab(recipe)
    if fields["tokenizer_type"] == "NullTokenizer" and fields["vocab_size"] is not None:
        fields["vocab_size"] -= 1  # Megatron-LM's NullTokenizer appends its end-of-document id to the --vocab-size ids
    p, m, t = recipe.parallel, recipe.model, recipe.train
    dtypes = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
    for name in _DTYPE_FIELDS:
        fields[name] = dtypes.get(fields[name], torch.float32)
    vp = p.virtual_pipeline if p.virtual_pipeline and p.virtual_pipeline > 1 else None
    fields.update(
        # validate_args
        data_parallel_size=recipe.data_parallel_size, params_dtype=dtypes[t.precision],
        transformer_pipeline_model_parallel_size=p.pipeline, virtual_pipeline_model_parallel_size=vp,
        num_virtual_stages_per_pipeline_rank=vp, overlap_p2p_comm=vp is not None and fields["overlap_p2p_comm"],
        align_param_gather=vp is not None and fields["align_param_gather"],
        encoder_num_layers=m.num_layers,
        encoder_seq_length=m.seq_length, use_dist_ckpt=ckpt_format != "torch", ckpt_format=ckpt_format,
        variable_seq_lengths=False, dataloader_type="single", transformer_impl=transformer_impl,
        apply_rope_fusion=m.position_embedding == "rope" and fields["apply_rope_fusion"],
        # bf16 reduces gradients in fp32 (fp32 main grads); fp16's dynamic loss scaling reads NaNs as overflow
        accumulate_allreduce_grads_in_fp32=t.precision == "bf16" and not fields["grad_reduce_in_bf16"]
        and fields["main_grads_dtype"] == torch.float32 or fields["accumulate_allreduce_grads_in_fp32"],
        check_for_nan_in_loss_and_grad=fields["check_for_nan_in_loss_and_grad"]
        and not (t.precision == "fp16" and not fields["loss_scale"]),
        # training
        consumed_train_samples=consumed_samples, consumed_valid_samples=0, skipped_train_samples=0,
        padded_vocab_size=padded_vocab_size, iteration=iteration, curr_iteration=iteration,
        num_floating_point_operations_so_far=num_floating_point_operations, model_type=ModelType.encoder_or_decoder,
        do_train=True, do_valid=t.eval_interval is not None, do_test=False,
    )
    return argparse.Namespace(**fields)


def _tokenizer_vocab(recipe) -> int | None:
    from megacli.data.tokenizers import load_tokenizer

    try:
        return load_tokenizer(type=recipe.tokenizer.type, path=recipe.tokenizer.path).vocab_size
    except Exception:  # noqa: BLE001 - args.vocab_size stays unset, as for a run that never named it
        return None


def flag_table() -> list[tuple[str, str]]:
    """(Megatron-LM option as the README shows it, recipe key), one row per option, in FLAGS order."""
    return [(f.readme(), f"`{f.key}`") for f in FLAGS]


def args_not_reproduced(args, recipe) -> list[str]:
    """The mapped Megatron-LM arguments (FLAGS) whose value in a run's ``args`` the validated
    ``recipe`` does not give back: what a recipe made from those args leaves out or changes."""
    out = []
    for flag in FLAGS:
        if flag.arg in ("vocab_size", "tokenizer_type", "tokenizer_model", "vocab_file", "data_path", "mock_data",
                        "world_size"):
            continue  # the vocabulary, tokenizer, data and world are the recipe reader's own notes
        if not hasattr(args, flag.arg):
            continue
        given, mapped = getattr(args, flag.arg), flag.value(recipe)
        if _same_arg(given, mapped):
            continue
        out.append(f"{flag.option} {given!r} (the recipe's {flag.key} gives {mapped!r})")
    return out


def _same_arg(a, b) -> bool:
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same_arg(x, y) for x, y in zip(a, b))
    if isinstance(a, str) and isinstance(b, str):
        return a.replace(" ", "") == b.replace(" ", "")
    return a == b
