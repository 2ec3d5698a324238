"""Every Triton kernel of nam56r_kernels compiles for Hopper (sm_90) at the dtypes and compile-time sizes NAM56R
launches it with: Triton's real compiler and ptxas, on a machine without a GPU. The CPU interpreter accepts
programs the compiler rejects, so this is what fails before a GPU run would."""

from __future__ import annotations

import pytest

HOPPER = ("cuda", 90, 32)


def _kernels():
    from nam56r_kernels import (
        dsa_indexer,
        expert_activation,
        linear_cross_entropy,
        moe_permute,
        moe_routing,
        residual_rms_norm,
        router_gating,
    )

    scores = {"q_ptr": "*bf16", "k_ptr": "*bf16", "w_ptr": "*bf16", "out_ptr": "*fp32", "sq": "i32", "sk": "i32",
              **{name: "i64" for name in ("stride_qs", "stride_qb", "stride_qh", "stride_ks", "stride_kb", "stride_ws",
                                          "stride_wb", "stride_wh", "stride_ob", "stride_os")}}
    select = {"scores_ptr": "*fp32", "out_scores_ptr": "*fp32", "out_indices_ptr": "*i32", "sk": "i32", "kept": "i32",
              "stride_row": "i64", "stride_out": "i64"}
    rows = {"src_ptr": "*bf16", "out_ptr": "*bf16", "rows_ptr": "*i32", "hidden": "i32"}
    sum_rows = {"src_ptr": "*bf16", **{f"addend{i}_ptr": "*bf16" for i in range(3)}, "out_ptr": "*bf16", "rows_ptr": "*i32",
                "hidden": "i32"}
    counts = {"selected_ptr": "*u8", "block_counts_ptr": "*i32", "tokens": "i32"}
    table = {"selected_ptr": "*u8", "probs_ptr": "*fp32", "block_counts_ptr": "*i32", "counts_ptr": "*i64", "rows_ptr": "*i32",
             "row_probs_ptr": "*fp32", "covered_ptr": "*u8", "tokens": "i32", "num_rows": "i32", "num_blocks": "i32"}
    table_blocks = {"EXPERTS": 16, "BLOCK_T": moe_permute._TABLE_BLOCK_T, "BLOCK_E": 16}
    gating = {"x_ptr": "*bf16", "w_ptr": "*bf16", "out_ptr": "*fp32", "tokens": "i32", "hidden": "i32", "experts": "i32"}
    gating_dgrad = {"g_ptr": "*fp32", "w_ptr": "*bf16", "gx_ptr": "*bf16", "tokens": "i32", "hidden": "i32", "experts": "i32"}
    gating_wgrad = {"g_ptr": "*fp32", "x_ptr": "*bf16", "partial_ptr": "*fp32", "tokens": "i32", "hidden": "i32",
                    "experts": "i32"}
    gating_blocks = {"BLOCK_T": router_gating._BLOCK_T, "BLOCK_H": router_gating._BLOCK_H, "BLOCK_E": 16}
    cross_entropy = {"logits_ptr": "*bf16", "labels_ptr": "*i64", "weights_ptr": "*fp32", "loss_ptr": "*fp32",
                     "predictions_ptr": "*i64", "vocab": "i32", "stride_row": "i64", "ignore_index": "i32"}
    activation = {"h_ptr": "*bf16", "scale_ptr": "*fp32", "out_ptr": "*bf16", "n_rows": "i32", "n_cols": "i32"}
    activation_bwd = {"grad_ptr": "*bf16", "h_ptr": "*bf16", "scale_ptr": "*fp32", "grad_h_ptr": "*bf16",
                      "grad_scale_ptr": "*fp32", "n_rows": "i32", "n_cols": "i32"}
    routing = {"logits_ptr": "*fp32", "bias_ptr": "*fp32", "probs_ptr": "*fp32", "map_ptr": "*u8", "counts_ptr": "*i32",
               "q_sums_ptr": "*fp32", "seq_len": "i32", "batch": "i32", "scaling": "fp32"}
    routing_reduce = {"counts_ptr": "*i32", "q_sums_ptr": "*fp32", "tokens_per_expert_ptr": "*i64", "aux_loss_ptr": "*fp32",
                      "aux_counts_ptr": "*fp32", "blocks": "i32", "batch": "i32", "aux_scale": "fp32"}
    routing_bwd = {"logits_ptr": "*fp32", "map_ptr": "*u8", "aux_counts_ptr": "*fp32", "grad_probs_ptr": "*fp32",
                   "grad_aux_ptr": "*fp32", "grad_logits_ptr": "*fp32", "seq_len": "i32", "batch": "i32", "scaling": "fp32",
                   "aux_scale": "fp32"}
    norm = {"x_ptr": "*bf16", "w_ptr": "*bf16", "y_ptr": "*bf16", "rstd_ptr": "*fp32", "hidden": "i32", "eps": "fp32"}
    norm_bwd = {"grad_y_ptr": "*bf16", "grad_res_ptr": "*bf16", "x_ptr": "*bf16", "w_ptr": "*bf16", "rstd_ptr": "*fp32",
                "grad_x_ptr": "*bf16", "partial_ptr": "*fp32", "rows": "i32", "hidden": "i32", "rows_per_program": "i32"}
    norm_block = {"BLOCK_H": residual_rms_norm._block(4096)[0]}  # NAM56R's hidden size
    e_pad, block_s = moe_routing._blocks(4096, 16)  # NAM56R's S = 4096 positions of 16 experts
    blocks = {"PRODUCT_FP32": True, "BLOCK_ROWS": expert_activation._BLOCK_ROWS, "BLOCK_COLS": expert_activation._BLOCK_COLS}
    # (kernel, signature, compile-time values): NAM56R's indexer (32 heads x 64, relu, causal), its select over 4096
    # keys keeping the top-256 and, in the dense warm-up, all 4096; the MoE permute at hidden 4096 and 16 experts; the
    # experts' activation on bf16 with fp32 probs; the layers' input norm at hidden 4096; the router's gating over 16
    # experts (the GPU's bf16 path) and its top-4 routing with the expert bias and the seq aux loss.
    return {
        "index scores": (dsa_indexer._index_scores_kernel, scores,
                         {"HEADS": 32, "DIM": 64, "BLOCK_M": dsa_indexer._SCORE_BLOCK_M, "BLOCK_N": dsa_indexer._SCORE_BLOCK_N,
                          "USE_RELU": True, "CAUSAL": True, "DOT_PRECISION": "tf32"}),
        "top-256 select": (dsa_indexer._select_topk_kernel, select, {"ROW": 4096, "KEEP": 256}),
        "dense warm-up select": (dsa_indexer._select_topk_kernel, select, {"ROW": 4096, "KEEP": 4096}),
        "cross-entropy rows": (linear_cross_entropy._cross_entropy_rows_kernel, cross_entropy,
                               {"BLOCK": linear_cross_entropy._ROW_BLOCK}),
        "moe copy to rows": (moe_permute._copy_to_rows_kernel, rows, {"EXPERTS": 16, "BLOCK_H": moe_permute._BLOCK_H}),
        "moe sum rows": (moe_permute._sum_rows_kernel, sum_rows, {"EXPERTS": 16, "BLOCK_H": moe_permute._BLOCK_H, "ADDENDS": 1}),
        "moe sum rows, fanned-out gradient": (moe_permute._sum_rows_kernel, sum_rows,
                                              {"EXPERTS": 16, "BLOCK_H": moe_permute._BLOCK_H, "ADDENDS": 2}),
        "moe block counts": (moe_permute._block_counts_kernel, counts, table_blocks),
        "moe routing rows": (moe_permute._routing_rows_kernel, table, {**table_blocks, "CHUNK": moe_permute._TABLE_CHUNK}),
        "router gating forward": (router_gating._gating_fwd, gating, {**gating_blocks, "UPCAST": False}),
        "router gating input gradient": (router_gating._gating_dgrad, gating_dgrad, {**gating_blocks, "UPCAST": False}),
        "router gating weight gradient": (router_gating._gating_wgrad, gating_wgrad,
                                          {"ROWS": router_gating._WGRAD_ROWS, **gating_blocks, "UPCAST": False}),
        "moe routing forward": (moe_routing._routing_fwd, routing,
                                {"TOPK": 4, "EXPERTS": 16, "E_PAD": e_pad, "BLOCK_S": block_s, "HAS_BIAS": True, "HAS_SCALE": False,
                                 "HAS_AUX": True}),
        "moe routing reduce": (moe_routing._routing_reduce, routing_reduce,
                               {"EXPERTS": 16, "E_PAD": e_pad, "B_PAD": 8, "HAS_AUX": True, "AUX_COUNTS": 1}),
        "moe routing backward": (moe_routing._routing_bwd, routing_bwd,
                                 {"EXPERTS": 16, "E_PAD": e_pad, "BLOCK_S": block_s, "NORMALIZE": True, "HAS_SCALE": False,
                                  "HAS_GRAD_PROBS": True, "HAS_GRAD_AUX": True}),
        "expert activation forward": (expert_activation._scaled_gelu_fwd, activation, blocks),
        "expert activation backward": (expert_activation._scaled_gelu_bwd, activation_bwd, blocks),
        "layer input norm forward": (residual_rms_norm._rms_norm_fwd, norm, norm_block),
        "layer input norm backward": (residual_rms_norm._rms_norm_bwd, norm_bwd, {"RESIDUAL": True, **norm_block}),
    }


@pytest.mark.parametrize("name", ["index scores", "top-256 select", "dense warm-up select", "cross-entropy rows",
                                  "moe copy to rows", "moe sum rows", "moe block counts", "moe routing rows",
                                  "router gating forward", "router gating input gradient", "router gating weight gradient",
                                  "moe routing forward", "moe routing reduce", "moe routing backward",
                                  "expert activation forward", "expert activation backward", "layer input norm forward",
                                  "layer input norm backward"])
def test_the_kernel_compiles_for_hopper(name: str) -> None:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    kernel, signature, constants = _kernels()[name]
    signature = {**signature, **{key: "constexpr" for key in constants}}
    assert list(signature) == kernel.arg_names, f"{name}: the signature here is out of date with the kernel's arguments"
    compiled = triton.compile(ASTSource(fn=kernel, signature=signature, constexprs=constants), target=GPUTarget(*HOPPER))
    assert compiled.asm["cubin"] and ".target sm_90" in compiled.asm["ptx"]
