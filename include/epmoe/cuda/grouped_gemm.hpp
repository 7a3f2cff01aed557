// FP8 block-scaled grouped GEMM on Hopper (sm_90a), contiguous and masked layouts (design.md §3,
// §4; issue 4). CPU twin: epmoe/grouped_gemm.hpp.
//
//   D[m, n] = Σ_k A[m, k] · B[g(m), n, k]
//
// A e4m3 with one f32 scale per (row, 128-wide K block); B e4m3 [G, N, K] with one f32 scale_inv per
// 128 x 128 block [G, N/128, K/128] (the DeepSeek-V3 checkpoint format); f32 accumulation, promoted
// with the scales at every 128-wide K block (per-block wgmma accumulators, then acc += sa·sb·partial,
// as DeepGEMM does); bf16 output.
//
// A scales come in either layout of epmoe/cuda/quant.hpp (ScaleLayout), as the per-token-group
// quantizer writes them; a producer warp copies each K block's scales into shared memory beside the
// tiles (cp.async, element by element), so no transform is needed for either:
//   token_major:  contiguous [M, K/128];               masked [G, M_max, K/128]
//   mn_major_tma: contiguous [K/128, tma_aligned(M)];  masked [G, K/128, tma_aligned(M_max)]
//
// Every call only enqueues one kernel on `stream` (no allocation, no host synchronisation; the
// masked call reads masked_m on the device, so it can be captured in a CUDA graph). Tensors are
// Device::cuda views, contiguous; a, b and d 16-byte aligned; K and N multiples of
// 128. Argument errors throw epmoe::Error naming the argument. Needs an sm_90 GPU.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include <cuda_runtime_api.h>

#include "epmoe/cuda/quant.hpp"
#include "epmoe/tensor.hpp"

namespace epmoe::cuda {

struct GroupedGemmOptions {
  // Rows per output tile: 0 picks by grouped_gemm_tile(); else 64 or 128.
  int block_m = 0;
  // Columns per output tile: 0 picks by grouped_gemm_tile(); else 128 or 256 (N a multiple of it;
  // 256 with 128-row tiles only).
  int block_n = 0;
  // At most this many CTAs (persistent, one per SM); 0: every SM of the device.
  int max_ctas = 0;
  // Contiguous layout: the tile order walks bands of this many columns (all m-blocks of a band, its
  // column tiles fastest, then the next band); 0: 1024 (512, 2048 and all of N measured level or
  // slower, bench/NOTES.md session 30). Wider bands read each A block from HBM fewer times, narrower
  // ones keep less of B in L2. Rounded down to whole column tiles (at least one).
  int band_columns = 0;

  // Tuning and timing experiments (the bench); the defaults are the tuned choice.
  // Pipeline stages: 0 = as many as fit in shared memory, else 1 .. that many.
  int stages = 0;
  // Tiles with at most 32 valid rows load only those rows of A (decode).
  bool small_a_box = true;
  // v35, with small_a_box: 64-row tiles load only A's boxes of this many rows that hold valid rows (16: a
  // tile of 33-48 rows 48 of them, not 64; of 1-16 rows 16, not 32). -1 (automatic): from K = 4096 on, 8
  // where the masked caller expects at most 16 rows per group (decode), else 16 (measured: decode 128 x 8
  // at K = 7168 1.2% faster than without, 0.4% faster than 16; level or up to 0.4% slower at K = 2048,
  // bench/NOTES.md session 47); 0: off (small_a_box alone); 8 or 16. v37: also the boxes of the zero-padding
  // 128 x 256 tiles (zero_padding_rows; 32 rows without them), automatically where a masked launch splits its
  // tiles and expects at most 32 rows per group (measured 0.3-1.6% faster there, session 48; whole tiles of
  // 65+ rows in 16-row boxes took up to 8 loads per K block: 3-17% slower), and wherever 8 or 16 is asked
  // for.
  int a_row_box_rows = -1;
  // Tiles with at least 32 padding rows load only A's 32-row boxes that hold valid rows, and zeros over
  // the rest (a bulk copy of a small zero buffer, once per stage and tile): the padding rows' products,
  // which are never stored, then cost the tensor cores less energy, and a card whose clock drops under
  // tensor work runs faster (v29, bench/NOTES.md session 43). Takes precedence over small_a_box. 128 x 256
  // tiles only, not in a cluster; masked launches and contiguous ones with groups of fewer than 2048 rows on
  // average (larger groups have few padded tiles, and the kernel without the code ran 0.7-0.8% faster there).
  bool zero_padding_rows = true;
  // L2 promotion of the TMA loads: 0 = 256 bytes, 1 = none, 2 = 128 bytes.
  int l2_promotion = 0;
  // Bits, 0: off. 1: skip the tensor-core work and the promotion; 2: skip the loads (the pipeline
  // still runs); 4: promote one accumulator per wave (the wgmma results must stay live, or the
  // compiler drops the wgmma); 8: one wgmma wait and promotion per K block (the waves
  // accumulate into one partial); 16: no output stores; 32: no scale copies; 64: the consumers do
  // not wait for a stage's data; 128: no pipeline (producers idle, consumers neither wait nor free a
  // stage). All leave garbage in d: for locating a bottleneck only. 256 (not an ablation, output
  // intact): every CTA adds its consumer loop's cycles and time to the trace that
  // fp8_grouped_gemm_take_trace reads. 512: each consumer warp spins 200 cycles per K block. 1024:
  // (v12 launches) the next tile's loads into the borrowed stages do not wait for the stores. 2048 (not
  // an ablation, output intact): per-CTA stamps (fp8_grouped_gemm_take_cta_trace).
  int ablation = 0;
  // CTAs per cluster along N: 0 = automatic (1: measured level or faster than 2 on every anchor
  // row, bench/NOTES.md session 13), 1, or 2 (each pair of CTAs computes two neighbouring column
  // tiles and shares the A tile through TMA multicast; 128-row tiles and an even N / block_n only).
  int cluster = 0;
  // 128-row tiles: the two consumer warpgroups issue their tensor-core work in turn (ping-pong).
  // Off by default: measured 13% slower than leaving them alone (bench/NOTES.md, v3).
  bool pingpong = false;
  // 128-row tiles: consumer warpgroup 1 starts each tile's first wgmma wave only once warpgroup 0
  // has issued its own (one named barrier per tile), after which the two run free, half a wave
  // apart, so that one's promotion can run under the other's wgmma (ignored with pingpong).
  bool consumer_skew = false;
  // The consumers' K loop unrolled over the pipeline stages where K / 128 is a multiple of them
  // (every stage address, barrier and descriptor then a uniform base plus an immediate): 10% fewer
  // loop cycles, 2-7% less time on every contiguous anchor row (bench/NOTES.md, session 11).
  bool unrolled_k_loop = true;
  // 16-byte output stores after a transpose across lanes (else 4-byte stores straight from the
  // accumulator layout).
  bool vector_epilogue = true;
  // v7, tiles of one 128-column wave (block_n = 128, and 64 x 128): K blocks alternate between two
  // partial accumulators, each block's wgmma issued before the previous block's are waited for and
  // promoted (else one partial, waited for before its promotion; measured 3-15% slower:
  // bench/NOTES.md, session 11). EPMOE_GEMM_TWO_PARTIALS=0|1 overrides it. Ignored with pingpong /
  // consumer_skew / ablations (the trace aside).
  bool two_partials = true;
  // v11, 128 x 256 tiles without a cluster: a tile with at most 64 valid rows (a group's last block,
  // or a small masked group) is computed as 64 x 256, each consumer warpgroup taking 128 of its
  // columns, instead of one warpgroup computing padding rows. A split launch has no v12 epilogue
  // (borrow_epilogue). 1: always; 0: never; -1 (automatic): in the contiguous layout with K <= 2048
  // and at most 512 rows per group on average (M / groups), where tails are many and a tile's fixed
  // costs weigh most: measured 6% faster on 32 groups x 256 rows and 3% on 128 x 128 at
  // 7168 x 2048, but 1-2% slower on groups of 1024+ rows there and 1-11% slower on every K = 7168 row
  // (a split tile loads as many bytes as a full one for half the work; bench/NOTES.md, sessions 15
  // and 30). In the masked layout where the caller expects at most 64 rows per group (the tile heuristic
  // gives 128 x 256 tiles from 9 rows on): 2.2-2.4% faster than whole tiles with 24-48 rows (+-30%) at
  // K = 7168, level at 64 (session 48); not with more, where only a group's last m-block splits: 9-14%
  // slower at K = 7168 on 32 x 128 / 32 x 192 (session 31).
  // EPMOE_GEMM_SPLIT_TILES=0|1 overrides it. Ignored with pingpong / consumer_skew / 4-byte stores /
  // ablations (the trace aside).
  int split_tiles = -1;
  // v12, 128 x 256 tiles with the unrolled K loop, no cluster: the consumers write each tile's
  // output into the B halves of its last two pipeline stages and go on at once; the producer
  // warpgroup's idle warp stores it from there with TMA (tensor stores for whole warps of rows, 1D
  // bulk stores per valid row otherwise) and frees the two stages for the next tile's loads. Without
  // it the consumers store from registers and wait for their stores (~13 cycles per wgmma at K = 2048
  // whether 132 or 66 SMs store at once). Measured 2-7% faster on 8 of the 10 contiguous anchor rows,
  // 1% slower on one, mixed (+-3%) on the masked 128 x 256 rows: 3% less time over the contiguous rows
  // (bench/NOTES.md, session 15). 2 (v31): only the first 128 columns are staged, in 32 KB of shared
  // memory of their own, and stored by the idle warp; the consumers store the other 128 themselves
  // after the hand-over, so no pipeline stage is borrowed and the next tile's loads never wait for the
  // store (no v21 split tail with it). 1: always; 0: never; -1 (automatic,
  // grouped_gemm_borrow_epilogue): 2 in the masked layout with K <= 2048, where it measured 2-3% faster
  // than the consumers' own stores on 32 x 192 and ~1% on 32 x 128 (which were 1-3.5% faster than 1
  // there, session 31), 3 in the contiguous layout, 1 elsewhere (2 measured 2-4% slower on the large
  // contiguous rows, slower at K = 7168; bench/NOTES.md, session 45). 3 (v33): 1 whose consumer warps
  // stage wave 0 (memory of their own) before the two consumers meet and wave 1 (the borrowed stage)
  // after, so that the consumer that finishes first stages while the other computes: ~135 cycles less per
  // tile's epilogue, 0.1-0.5% on the contiguous K = 2048 rows, level at K = 7168, 0.2% slower on masked
  // K = 7168 (session 47). EPMOE_GEMM_BORROW_EPILOGUE=0..3 overrides it. Ignored with split_tiles, pingpong,
  // consumer_skew, 4-byte stores and ablations.
  int borrow_epilogue = -1;
  // With borrow_epilogue: a tile whose 128 rows are all valid leaves as one tensor store per 128
  // columns (2) instead of one per consumer warp and 128 columns (16): each TMA store costs the store
  // warp ~150 cycles, and the next tile's load into the borrowed stage waits for the store
  // (bench/NOTES.md, sessions 36-37). Measured faster on the contiguous K = 2048 rows that borrow
  // (2.6-4.2%) and on K = 7168 rows with groups of 1024+ rows (0.8-1.5%), slower on K = 7168 rows
  // with groups of 128-256 rows (up to 2% with v19's staging, 8.6% before).
  // 1: always; 0: never; -1 (automatic): grouped_gemm_tile_store.
  // EPMOE_GEMM_TILE_STORE=0|1 overrides it.
  int tile_store = -1;
  // v21, the split tail: the tiles left over after the last whole round of the persistent CTAs
  // (tiles mod CTAs, when fewer than half the CTAs) are split along K into chunks for the CTAs that
  // would idle; each chunk writes an f32 partial into `workspace`, and the last chunk to finish sums
  // them in chunk order (the result does not depend on which chunk finishes last) and stores the
  // tile. -1 (automatic): where a workspace is given and a cost model (a chunk's K blocks, ~2.3 K
  // blocks per chunk for the sum, ~4 for the split itself) predicts a gain, with its chunk count:
  // measured 5% faster on masked 32 x 128 at K = 7168, 0.7-1.7% on the K = 7168 rows whose tail
  // splits, never at K = 2048 (bench/NOTES.md, session 38). 1: every tail of fewer than half the CTAs
  // split into as many chunks as fit (needs the workspace; tests, experiments; as many chunks measured
  // slower than the model's); 0: off. EPMOE_GEMM_SPLIT_TAIL=0|1 overrides it (1: automatic, where a
  // workspace is given). Not with a cluster, split_tiles, pingpong,
  // consumer_skew, 4-byte stores or the ablations (the trace aside).
  // Batch invariance: without a split, a row's output bits depend only on its activations and its
  // group's weights (not on the other rows of the launch, the tile, the layout or the CTA count:
  // GroupedGemmGpuMisc.RowsDoNotDependOnTheBatchTheTileOrTheLayout). A split tile sums K in chunks,
  // so its rows can differ from an unsplit launch's in the last bits (within the tolerance; the same
  // launch repeated gives the same bits). That is why the layer's runner passes no workspace: its
  // two-batch overlap and every bit-exact comparison of the layer rely on batch invariance.
  int split_tail = -1;
  // v22, the tail as pieces (128 x 256 tiles): where the tiles past the grid's last whole round number
  // at most a quarter of the CTAs (contiguous: known on the host; masked: decided on the device, from
  // masked_m), a 64 x 128 launch right after the 128 x 256 one computes each of them as four 64 x 128
  // pieces on the SMs the whole rounds leave (a programmatic dependent launch; no workspace, and every
  // element the same sum over K as in a whole tile: batch-invariant). Takes precedence over split_tail
  // where both apply. -1 (automatic): contiguous only (masked, the follower launch is made whether or
  // not the tail fits, and measured 2-4% slower, bench/NOTES.md session 39); 1: on; 0: off.
  // EPMOE_GEMM_TAIL_PIECES=0|1 overrides it. Not with a cluster, split_tiles, pingpong, consumer_skew
  // or the ablations (the trace aside).
  int tail_pieces = -1;
  // v30, the trimmed grid (no cluster, no tail pieces; not 128 x 128 masked, not with split_tiles
  // contiguous): where the tiles leave the grid's last round at least half busy (and so are not split,
  // split_tail), the launch runs them on as few CTAs as keep the same number of rounds,
  // ceil(T / ceil(T / CTAs)), each with the same number of tiles. Contiguous: the host sizes the grid;
  // masked: the device counts the tiles from masked_m and the CTAs past the count exit at once. The busy
  // SMs of a power-capped card then run at a higher clock: masked 32 x 192 at K = 7168 0.8-1.0% faster on
  // 128 of 132 CTAs, contiguous 32 x 256 0.6% on 130; but the decode rows (a last round of 4 tiles) 0.5%
  // slower, hence the half-round rule (bench/NOTES.md, session 44). Every tile is still computed whole by
  // one CTA: the same bits. -1 (automatic): contiguous, by the rule; masked where the tiles the host
  // expects (every group expected_m rows) would meet it and the launch does not split its tiles (split_tiles:
  // memory-bound small groups, 0.2-0.5% faster on every SM, session 48), the device's count deciding; 1:
  // every launch the rule may apply to (masked: the device still decides); 0: off. EPMOE_GEMM_TRIM_CTAS=0|1
  // overrides it.
  int trim_ctas = -1;
  // Masked layout: swapped operands (D^T = B · A^T: the weights as the tensor cores' M, 128 rows per
  // tile, a group's 256-token chunk as their N in one wave of 16 .. 176 tokens, two of 96 .. 120 or three
  // of 88), so that groups of 65-256 rows compute their rows to within 16 per wave instead of padding
  // them to 64- or 128-row blocks. Measured 5-12% slower than the row-major kernel on every masked anchor
  // row (bench/NOTES.md, sessions 41-42), hence off by default; the same bits as the row-major kernel
  // in every valid row. 1: on; 0: off; -1 (automatic): grouped_gemm_swap_ab.
  // EPMOE_GEMM_SWAP_AB=0|1 overrides the automatic choice. With 1, block_m,
  // block_n, cluster, pingpong and consumer_skew must stay at their defaults (the tile is its own); the
  // row-major kernel's other options do not apply to it (stages and l2_promotion do). At most 1024
  // (group, 256-row chunk) pairs, G x ceil(M_max / 256) (automatic: the row-major kernel beyond).
  // Refused in the contiguous layout.
  int swap_ab = -1;
  // The split tail's device memory: at least grouped_gemm_workspace_bytes() bytes, 256-byte aligned,
  // zero-filled once before its first use (the kernel leaves it so), and used by one launch at a time
  // (launches on different streams need workspaces of their own).
  void* workspace = nullptr;
  std::size_t workspace_bytes = 0;
};

// The bytes GroupedGemmOptions::workspace needs on the current device (every SM a CTA: per CTA one
// 128 x 256 f32 partial and its counters).
std::size_t grouped_gemm_workspace_bytes();

// The automatic split tail's chunks per tail tile (1: no split) for K, the launch's quantum of K blocks
// (its pipeline stages where the unrolled K loop runs, else 1) and `limit`, the chunks that fit
// (CTAs / tail tiles): the cost model of GroupedGemmOptions::split_tail.
int grouped_gemm_split_tail_chunks(std::int64_t k, int quantum, int limit);

// The tile heuristic (block_m x block_n). Masked with expected_m <= 8 (decode), or <= 64 with N not a
// multiple of 256: 64 x 128 (reading the weights bounds the time; 64-row tiles halve the wasted
// tensor-core work and A traffic, and v35 loads A in 8-row boxes there). Otherwise 128 x 256 when
// N % 256 == 0 (a quarter less L2 -> shared-memory traffic per flop than 128 x 128: each consumer
// warpgroup runs two 128-column waves per K block), else 128 x 128; masked groups of 9-64 rows then run
// split (split_tiles: a tile of <= 64 rows as 64 x 256, A read once per 256 columns; v37's row boxes from
// K = 4096 on), measured 1.6% faster than 64 x 128 on 128 x 16 and 1.6-2.2% on 32 x 24-48 at K = 7168,
// 8-11% at 64 rows (bench/NOTES.md, session 48).
// Options that force only block_m get that height's width: 64 -> 128, 128 -> as above.
struct GemmTileShape {
  int block_m = 128;
  int block_n = 128;
};
GemmTileShape grouped_gemm_tile(bool masked, std::int64_t expected_m, std::int64_t n);

// The automatic choice of GroupedGemmOptions::split_tiles (-1): split in the contiguous layout when
// K <= 2048 and the M rows of A hold at most 512 per group on average (m <= 512 groups); in the masked
// layout when the caller expects 1-64 rows per group (m, the expected rows in all: 1 .. 64 groups).
bool grouped_gemm_split_tiles(bool masked, std::int64_t m, std::int64_t groups, std::int64_t k);

// The automatic choice of GroupedGemmOptions::borrow_epilogue (-1): 2 (v31: the first 128 columns
// staged, the rest stored by the consumers) in the masked layout with K <= 2048, else 1 (v12's
// borrowed-stage epilogue).
int grouped_gemm_borrow_epilogue(bool masked, std::int64_t k);

// The automatic choice of GroupedGemmOptions::swap_ab (-1), masked layout, from the expected rows
// per group: never yet (measured slower everywhere).
bool grouped_gemm_swap_ab(std::int64_t expected_m);
// The automatic choice of GroupedGemmOptions::tile_store (-1): whole-tile stores when K <= 2048, or in
// the contiguous layout when the M rows of A hold at least 512 per group on average (M >= 512 groups).
bool grouped_gemm_tile_store(bool masked, std::int64_t m, std::int64_t groups, std::int64_t k);

// Contiguous layout:
//   a [M, K] fp8_e4m3; a_scales f32 (layout above); b [G, N, K] fp8_e4m3; b_scales [G, N/128, K/128] f32;
//   m_indices [M] i32: the group of each row, -1 on padding rows; every 128-row block (counted from
//   row 0) must hold rows of at most one group, as the contiguous layout pads each group to 128.
//   d [M, N] bf16 (out): rows whose m_indices is -1 are left untouched (ids outside [-1, G) are a
//   caller error: such rows are left untouched too, or the block is skipped).
void fp8_grouped_gemm_contiguous(TensorView a, TensorView a_scales, ScaleLayout a_scale_layout, TensorView b,
                                 TensorView b_scales, TensorView m_indices, TensorView d, cudaStream_t stream,
                                 const GroupedGemmOptions& options = {});

// Masked layout:
//   a [G, M_max, K] fp8_e4m3; a_scales f32 (layout above); b [G, N, K]; b_scales [G, N/128, K/128];
//   masked_m [G] i32 on the device: rows [0, masked_m[g]) of group g are valid (values are clamped
//   to [0, M_max]); expected_m: a host hint of the typical masked_m (tile choice only).
//   d [G, M_max, N] bf16 (out): rows >= masked_m[g] are left untouched.
void fp8_grouped_gemm_masked(TensorView a, TensorView a_scales, ScaleLayout a_scale_layout, TensorView b,
                             TensorView b_scales, TensorView masked_m, std::int64_t expected_m, TensorView d,
                             cudaStream_t stream, const GroupedGemmOptions& options = {});

// The consumer-loop trace of the launches with options.ablation bit 256 since the last call (sums
// over CTAs and launches; read on the current device, then zeroed). Cycles per wgmma per SM:
// loop_cycles / (k_blocks * wgmma per K block); the clock the loops ran at: loop_cycles / loop_ns.
// v12's hand-off (borrowing launches), cycles summed over CTAs: the producer's waits for epi_done and for
// empty stages, the store warp's time from a tile staged to its epi_done and its waits for staged tiles,
// and the tiles it stored.
struct Fp8GemmTrace {
  std::uint64_t loop_cycles = 0, loop_ns = 0, k_blocks = 0, ctas = 0, span_ns = 0, launches = 0;
  std::uint64_t epi_done_wait_cycles = 0, empty_wait_cycles = 0, store_cycles = 0, staged_wait_cycles = 0,
                stored_tiles = 0;
  // The traced consumer thread: its epilogue (K loop end to the tile staged or stored), its tiles.
  std::uint64_t epilogue_cycles = 0, consumer_tiles = 0;
  // The tile turn: the TMA warp's cycles in next() after each tile and its waits for K block 0's stage
  // (per tile: consumer_tiles).
  std::uint64_t producer_turn_cycles = 0, producer_kb0_wait_cycles = 0;
  // v21's split tail, the traced thread's warp: chunks of split tiles it computed, tiles it summed
  // (one per split tile: every tile's last-arriving warp 0 of consumer 0).
  std::uint64_t split_chunks = 0, split_reductions = 0;
  // ... and its cycles from a chunk's K loop end to its arrival counted (partial written), and summing.
  std::uint64_t split_write_cycles = 0, split_sum_cycles = 0;
};
Fp8GemmTrace fp8_grouped_gemm_take_trace();

// Per-CTA %globaltimer stamps (ns) of a GEMM launch (0: the CTA did not run): entry, its producer's last
// load issued, every pipeline stage released by the consumers after it (the K loops done).
struct GemmCtaStamps {
  std::uint64_t entry = 0, loads_issued = 0, drained = 0;
};
// The CTAs a launch stamps (the first ones of its grid).
inline constexpr int kGemmTraceMaxCtas = 1024;
// The stamps of the FP8 launches since the last take that ran with ablation bit 2048 (the 128-row and
// 64-row kernels; a CTA that ran in several launches keeps the last one's): the first `ctas` CTAs',
// cleared.
std::vector<GemmCtaStamps> fp8_grouped_gemm_take_cta_trace(int ctas, cudaStream_t stream);

}  // namespace epmoe::cuda
