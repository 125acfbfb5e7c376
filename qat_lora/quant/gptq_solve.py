"""GPTQ of one weight matrix given its inputs' H (Frantar et al., 2022; DESIGN §8): `gptq_quantize`.

With H = 2 XᵀX / n from the layer's real inputs X [n, in], GPTQ quantises the weight one input column at a time and
pushes each column's rounding error onto the not-yet-quantised columns, so that the layer output X Wᵀ (not the
weight) is what is preserved: the optimal-brain-surgeon update
    W[:, j:] -= (w_j - q_j) / U_jj * U_j,j:        U = upper Cholesky factor of H⁻¹  (paper, Alg. 1)
applied lazily per block of columns (the paper's "lazy batch" updates). Group scales/zeros are fitted when a
group starts, on that group's current, error-compensated weights (paper §4, "grouping"). The result is exactly a
FakeQuantLinear state: a weight on the grid plus the scale/zero (or scale/codebook) that map it to itself.

The column loop runs where the weight is: on a CUDA device each block's loop is replayed as a CUDA graph
(`_BlockGraph`: the loop is thousands of tiny ops, bound by launching them); on the CPU with one thread. float32,
the Cholesky in float64. quant/gptq.py runs it over a model, layer by layer.
"""
from __future__ import annotations

import warnings

import torch

from qat_lora.quant.fake_quant import QuantConfig
from qat_lora.quant.quantizer import ColumnGrid, quantizer_for


def _inverse_cholesky_upper(h: torch.Tensor, damp: float) -> torch.Tensor:
    """Upper Cholesky factor U of (H + damp * mean(diag H) * I)⁻¹ (U ᵀU = H⁻¹), float32 [in, in].

    Raises:
        ValueError: H is not positive definite even after damping.
    """
    h = h.double()
    h = h + torch.eye(h.shape[0], dtype=h.dtype, device=h.device) * (damp * torch.diag(h).mean())
    chol, info = torch.linalg.cholesky_ex(h)
    if info.item() == 0:
        chol, info = torch.linalg.cholesky_ex(torch.cholesky_inverse(chol), upper=True)
    if info.item() != 0:
        raise ValueError(f"GPTQ: the Hessian is not positive definite with damp={damp}; use a larger damp "
                         "(e.g. 0.1) or more calibration tokens")
    return chol.float()


def _group_now(w: torch.Tensor, w1t: torch.Tensor, deltas: list[torch.Tensor], v: torch.Tensor, i1: int, i: int,
               end: int) -> torch.Tensor:
    """Current weights [out, end - (i1 + i)] of columns i1+i .. end-1: those in the block are up to date in w1t
    (the block transposed, [columns, out]); later ones still owe the block's lazy update from the i columns already
    quantised (their rounding errors `deltas`, one [out] column each, times the row-normalised factor v)."""
    i2 = i1 + w1t.shape[0]
    inside = w1t[i:min(end, i2) - i1].T
    if end <= i2:
        return inside
    later = w[:, i2:end] - torch.stack(deltas, 1) @ v[i1:i1 + i, i2:end] if deltas else w[:, i2:end]
    return torch.cat([inside, later], 1)


def _aligned_block(w1t: torch.Tensor, v1: torch.Tensor, grid: ColumnGrid, group_size: int,
                   importance: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """GPTQ over one block whose groups lie inside it, on a block-local grid (group g = columns g*G ..): w1t
    [columns, out] (updated in place), v1 [columns, columns] the block of the row-normalised factor. Returns the
    grid values and rounding errors [out, columns]. Only tensor ops, no host read: a CUDA graph can replay it."""
    columns, v_rows = w1t.unbind(0), v1.triu(1).unbind(0)
    q_columns, deltas = [], []
    for i, w_col in enumerate(columns):
        if i % group_size == 0:
            grid.fit_(i // group_size, w1t[i:i + group_size].T, importance[i:i + group_size])
        q_col = grid.quantize(w_col, i // group_size)
        delta = w_col - q_col
        w1t.addr_(v_rows[i], delta, alpha=-1.0)  # OBS update of the rest of the block
        q_columns.append(q_col)
        deltas.append(delta)
    return torch.stack(q_columns, 1), torch.stack(deltas, 1)


class _BlockGraph:
    """`_aligned_block` captured once as a CUDA graph for one block shape and grid kind, replayed for every block of
    that shape: the column loop launches ~7 small kernels per column, which from Python costs the host ~30-50 us
    each on a GPU machine (GPTQ of a 1B model: 153 s on one H200, docs/BENCHMARKS.md); a replay launches them all
    at once. Built from a block already solved eagerly and kept only if its replay reproduces that block exactly.
    """

    def __init__(self, grid: ColumnGrid, w1t: torch.Tensor, v1: torch.Tensor, importance: torch.Tensor,
                 group_size: int, expected: tuple[torch.Tensor, ...]) -> None:
        self.w1t, self.v1, self.importance = w1t.clone(), v1.clone(), importance.clone()
        self.grid = grid.for_block(w1t.shape[0] // group_size)
        device = w1t.device
        side = torch.cuda.Stream(device)  # warm-up off the capturing stream, as torch.cuda.graph asks
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            _aligned_block(self.w1t.clone(), self.v1, self.grid, group_size, self.importance)
        torch.cuda.current_stream(device).wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.q, self.delta = _aligned_block(self.w1t, self.v1, self.grid, group_size, self.importance)
        if not all(torch.equal(a, b) for a, b in zip(self(w1t, v1, importance, grid), expected)):
            raise RuntimeError("GPTQ block graph: its replay differs from the eager block")

    def __call__(self, w1t: torch.Tensor, v1: torch.Tensor, importance: torch.Tensor,
                 grid: ColumnGrid) -> tuple[torch.Tensor, ...]:
        """q [out, columns], delta [out, columns] and the block's grid parameters, as `_aligned_block` gives on
        `grid` (its block inputs, e.g. fp8 scales' exponent, copied in)."""
        self.w1t.copy_(w1t)
        self.v1.copy_(v1)
        self.importance.copy_(importance)
        for mine, theirs in zip(self.grid.block_inputs(), grid.block_inputs(), strict=True):
            mine.copy_(theirs)
        self.graph.replay()
        return self.q.clone(), self.delta.clone(), *(p.clone() for p in self.grid.parameters().values())


def _solve_aligned_block(w1t: torch.Tensor, v1: torch.Tensor, grid: ColumnGrid, group_size: int,
                         importance: torch.Tensor, first_group: int, graphs: dict | None
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """One aligned block into `grid`'s groups first_group ..: replayed from `graphs` (CUDA; keyed by shape and grid
    kind, None there after a failed capture) or solved eagerly, the first block of a shape also capturing its graph."""
    key = (grid.block_key(), tuple(w1t.shape), group_size) if graphs is not None else None
    graph = graphs.get(key) if graphs is not None else None
    if graph is not None:
        q, delta, *params = graph(w1t, v1, importance, grid)
    else:
        original = w1t.clone() if graphs is not None and key not in graphs else None
        local = grid.for_block(w1t.shape[0] // group_size)
        q, delta = _aligned_block(w1t, v1, local, group_size, importance)
        params = list(local.parameters().values())
        if original is not None:
            try:
                graphs[key] = _BlockGraph(grid, original, v1, importance, group_size, (q, delta, *params))
            except RuntimeError as e:  # a grid whose fit reads the host, or a CUDA graph failure: stay eager
                graphs[key] = None
                warnings.warn(f"GPTQ: the column loop runs without a CUDA graph ({e})", RuntimeWarning, stacklevel=2)
    for target, value in zip(grid.parameters().values(), params):
        target[:, first_group:first_group + value.shape[1]].copy_(value)
    return q, delta


def gptq_quantize(weight: torch.Tensor, hessian: torch.Tensor, cfg: QuantConfig, group_size: int, *,
                  damp: float = 0.01, act_order: bool = False, block_size: int = 128,
                  params: dict[str, torch.Tensor] | None = None,
                  block_graphs: dict | None = None) -> dict[str, torch.Tensor]:
    """GPTQ-quantise one weight matrix onto a FakeQuantLinear grid.

    Args:
        weight: [out, in] full-precision weight. hessian: [in, in] H = 2 XᵀX / n of the layer's inputs.
        cfg: the layer's QuantConfig (int: bits, symmetric, init rtn|mse for the group fit; lut: bits).
        group_size: input columns per scale (in_features for per-channel).
        damp: fraction of mean(diag H) added to the diagonal (paper: 1 %).
        act_order: process columns by decreasing diag(H), with every group fitted up front on the original
            weights ("static groups"), so groups stay contiguous in the original column order.
        block_size: columns per lazy-batch update.
        params: the layer's quantiser parameters (FakeQuantLinear.quant_parameters()): the grids GPTQ keeps
            fixed (lut: scale and codebook; kquant: the two-level scales) need them; int / offset grids refit
            each group's scale and zero.
        block_graphs: on a CUDA device, the CUDA graphs of the column loop by block shape, shared between calls
            (gptq_ passes one per run: every layer's q/k/v reuse one graph); None: a graph for this call only.
    Returns:
        {"weight": Wq [out, in]} and the parameters GPTQ chose (int: "scale" [out, groups] fp16-representable,
        "zero" [out, groups] integer or fp16 offset; lut: "scale", "codebook"; kquant: none); float32, on
        `weight`'s device (where the column loop ran). Wq == FakeQuantLinear's fake-quantisation of Wq.
    Raises:
        ValueError: shapes that do not match, a lut / kquant call without params, or an H not positive definite.
    """
    _check_args(weight, hessian, cfg, group_size, damp, block_size)
    grid = quantizer_for(cfg, group_size).column_grid(params, *weight.shape, weight.device)
    if weight.device.type != "cpu":
        graphs = ({} if block_graphs is None else block_graphs) if weight.device.type == "cuda" else None
        return _gptq_quantize(weight, hessian, group_size, damp, act_order, block_size, grid, graphs)
    threads = torch.get_num_threads()
    # On the CPU the column loop is thousands of tiny ops: with more than one thread each pays OpenMP start-up
    # and, on a busy host, spin-waits (1536 x 576, w3g64, 2 busy cores: 75 s with 2 threads, 1.4 s with 1).
    torch.set_num_threads(1)
    try:
        return _gptq_quantize(weight, hessian, group_size, damp, act_order, block_size, grid, None)
    finally:
        torch.set_num_threads(threads)


def _gptq_quantize(weight: torch.Tensor, hessian: torch.Tensor, group_size: int, damp: float, act_order: bool,
                   block_size: int, grid: ColumnGrid, block_graphs: dict | None) -> dict[str, torch.Tensor]:
    out_features, in_features = weight.shape
    device = weight.device
    w = weight.detach().float().clone()
    h = hessian.detach().float().to(device).clone()
    dead = torch.diag(h) == 0  # inputs never active in calibration: H_ii = 1, W[:, i] = 0 (paper's code)
    h[dead, dead] = 1.0
    w[:, dead] = 0.0
    importance = torch.diag(h).clone()
    static = act_order or not grid.refits
    if grid.refits and (static or grid.fixes_range):  # every group fitted up front on the original weights: "static
        for group in range(in_features // group_size):  # groups", or the ranges fp8 scales' exponents need
            cols = slice(group * group_size, (group + 1) * group_size)
            grid.fit_(group, w[:, cols], importance[cols])
        grid.fix_range_()
    perm = torch.argsort(importance, descending=True) if act_order else torch.arange(in_features, device=device)
    w, h = w[:, perm], h[perm][:, perm]
    u = _inverse_cholesky_upper(h, damp)
    # U's rows divided by their diagonal: column j's rounding error delta_j = w_j - q_j moves the later columns by
    # delta_j * V[j, j+1:] (the paper's err_j = delta_j / U_jj times U[j, j+1:]), one outer-product update per
    # column. On an accelerator the column loop is bound by launching its small ops, so each op counts.
    v = u / torch.diagonal(u).unsqueeze(1)
    perm_host = perm.tolist()  # one read, not one per column
    # Groups that start and end inside every block (a refitting grid in column order, block_size a multiple of the
    # group): each block is then a function of its own columns only, `_aligned_block`, which a CUDA device replays
    # as one graph (`_BlockGraph`). Otherwise groups may span blocks and owe the lazy update (`_group_now`).
    aligned = grid.refits and not static and block_size % group_size == 0
    q_blocks = []
    for i1 in range(0, in_features, block_size):
        i2 = min(i1 + block_size, in_features)
        # The block transposed ([columns, out]: each column a contiguous row, all of them listed by one unbind) and
        # V's rows with the diagonal zeroed: the update of column i touches the whole block, where the columns up
        # to i get exactly -0 (V is upper triangular), so no per-column slicing: 6 dispatched ops per column.
        w1t = w[:, i1:i2].T.contiguous()
        if aligned:
            q_block, delta_block = _solve_aligned_block(w1t, v[i1:i2, i1:i2], grid, group_size, importance[i1:i2],
                                                        i1 // group_size, block_graphs)
        else:
            columns, v_rows = w1t.unbind(0), v[i1:i2, i1:i2].triu(1).unbind(0)
            q_columns, deltas = [], []
            for i, w_col in enumerate(columns):
                col = i1 + i
                if not static and col % group_size == 0:  # no permutation here: col is the original column
                    group_w = _group_now(w, w1t, deltas, v, i1, i, col + group_size)
                    grid.fit_(col // group_size, group_w, importance[col:col + group_size])
                q_col = grid.quantize(w_col, perm_host[col] // group_size)
                delta = w_col - q_col
                w1t.addr_(v_rows[i], delta, alpha=-1.0)  # OBS update of the rest of the block
                q_columns.append(q_col)
                deltas.append(delta)
            q_block, delta_block = torch.stack(q_columns, 1), torch.stack(deltas, 1)
        q_blocks.append(q_block)
        w[:, i2:] -= delta_block @ v[i1:i2, i2:]  # lazy update of the later blocks
    q = torch.cat(q_blocks, 1)
    wq = torch.empty_like(q)
    wq[:, perm] = q  # undo the act-order permutation
    return {"weight": wq, **grid.parameters()}


def _check_args(weight, hessian, cfg, group_size, damp, block_size) -> None:
    out_features, in_features = weight.shape
    if tuple(hessian.shape) != (in_features, in_features):
        raise ValueError(f"gptq_quantize: hessian {tuple(hessian.shape)} does not match weight "
                         f"{tuple(weight.shape)}; pass H = 2 XᵀX / n of shape [in, in]")
    if group_size <= 0 or in_features % group_size:
        raise ValueError(f"gptq_quantize: group_size={group_size} does not divide in_features={in_features}")
    if damp < 0 or block_size <= 0:
        raise ValueError(f"gptq_quantize: damp={damp}, block_size={block_size}: use damp >= 0, block_size > 0")
    if cfg.scale_rank:
        raise ValueError("gptq_quantize: low-rank scales (scale_rank > 0) are not supported; GPTQ-initialise "
                         "with scale_rank=0 and add the low-rank factors afterwards")
