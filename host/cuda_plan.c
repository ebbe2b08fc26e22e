#include "cuda_plan.h"

#include "cuda_internal.h"
#include "cuda_tiles.h"
#include "dtype.h"
#include "status.h"

#include <stddef.h>
#include <stdlib.h>
#include <string.h>

#ifdef WSYNC_WITH_CUDA
#include <cuda_runtime_api.h>
#endif

// ---------------------------------------------------------------------------
// Splitting ops over warps
//
// The ops of a plan form one stream of units (bytes for copies, elements for
// synthetic values) in op order. Warp w owns the units [w * share, (w + 1) *
// share) of that stream, so every warp gets the same amount of work whatever
// the ops' sizes: an op is cut where a warp's share ends, and tiny ops next to
// each other land in one warp. Pieces stay below a size limit (so that the
// kernels index them with 32-bit integers). A strided op is cut between rows
// (a warp may run up to one row past its share); one whose rows are wider
// than a share is cut row by row and within rows.

typedef void (*emit_fn)(void *context, size_t op, uint64_t row, uint64_t rows,
                        uint64_t column, uint64_t columns, uint32_t warp);

struct splitter {
  uint64_t share;     // units per warp
  uint32_t warps;
  uint64_t piece_max; // units per piece
  uint64_t align;     // units a cut keeps aligned to (a power of two)
  uint64_t position;  // units of the ops before the current one
  emit_fn emit;
  void *context;
};

static uint64_t min_u64(uint64_t a, uint64_t b) { return a < b ? a : b; }

static uint32_t warp_of(const struct splitter *splitter, uint64_t position) {
  uint64_t warp = position / splitter->share;
  return warp >= splitter->warps ? splitter->warps - 1 : (uint32_t)warp;
}

// Cuts `length` contiguous units that start at stream position `start` and
// at `phase` units past an alignment boundary of the target.
static void cut_stretch(struct splitter *splitter, size_t op, uint64_t row,
                        uint64_t column, uint64_t length, uint64_t start,
                        uint64_t phase) {
  uint64_t done = 0;
  while (done < length) {
    uint64_t at = start + done;
    uint32_t warp = warp_of(splitter, at);
    uint64_t room = warp + 1 < splitter->warps
                        ? (uint64_t)(warp + 1) * splitter->share - at
                        : length - done;
    uint64_t take = min_u64(length - done, room);
    int at_boundary = 1;
    if (take > splitter->piece_max) {
      take = splitter->piece_max;
      at_boundary = 0;
    }
    uint64_t over = (phase + column + done + take) & (splitter->align - 1);
    if (take < length - done && over != 0) {
      // End the piece on an aligned target address so that the next one
      // starts aligned: past a warp's boundary (the next warp starts a few
      // bytes late), before the piece limit.
      if (at_boundary && take + splitter->align - over <= splitter->piece_max)
        take = min_u64(take + splitter->align - over, length - done);
      else if (over < take)
        take -= over;
    }
    splitter->emit(splitter->context, op, row, 1, column + done, take, warp);
    done += take;
  }
}

// Splits one op of `rows` x `width` units (one stretch when `contiguous`)
// whose target starts `phase` units past an alignment boundary and advances
// `pitch` units per row.
static void split_op(struct splitter *splitter, size_t op, uint64_t rows,
                     uint64_t width, int contiguous, uint64_t phase,
                     uint64_t pitch) {
  uint64_t total = rows * width;
  if (total == 0)
    return;
  if (contiguous || rows == 1) {
    cut_stretch(splitter, op, 0, 0, total, splitter->position, phase);
  } else if (width > splitter->share || width > splitter->piece_max) {
    for (uint64_t row = 0; row < rows; row++)
      cut_stretch(splitter, op, row, 0, width,
                  splitter->position + row * width,
                  (phase + row * pitch) & (splitter->align - 1));
  } else {
    uint64_t row = 0;
    while (row < rows) {
      uint64_t at = splitter->position + row * width;
      uint32_t warp = warp_of(splitter, at);
      uint64_t take = rows - row;
      if (warp + 1 < splitter->warps) {
        uint64_t room = (uint64_t)(warp + 1) * splitter->share - at;
        take = min_u64(take, (room + width - 1) / width);
      }
      take = min_u64(take, splitter->piece_max / width);
      splitter->emit(splitter->context, op, row, take, 0, width, warp);
      row += take;
    }
  }
  splitter->position += total;
}

static void start_splitter(struct splitter *splitter, uint64_t total,
                           uint64_t min_per_warp, uint32_t warps,
                           uint64_t piece_max, uint64_t align, emit_fn emit,
                           void *context) {
  uint64_t wanted = (total + min_per_warp - 1) / min_per_warp;
  if (wanted < 1)
    wanted = 1;
  if (warps < 1)
    warps = 1;
  splitter->warps = wanted < warps ? (uint32_t)wanted : warps;
  uint64_t share = (total + splitter->warps - 1) / splitter->warps;
  share = (share + align - 1) & ~(align - 1);
  splitter->share = share > 0 ? share : align;
  splitter->piece_max = piece_max;
  splitter->align = align;
  splitter->position = 0;
  splitter->emit = emit;
  splitter->context = context;
}

// Where pieces go: counted, and written when there is room for them.
struct placement {
  size_t count;
  uint32_t *warp_start; // NULL while counting
  uint32_t last_warp;
};

static void place(struct placement *placement, uint32_t warp) {
  if (placement->warp_start != NULL)
    while (placement->last_warp < warp)
      placement->warp_start[++placement->last_warp] = (uint32_t)placement->count;
  placement->count++;
}

static void finish_placement(struct placement *placement, uint32_t warps) {
  if (placement->warp_start != NULL)
    while (placement->last_warp < warps)
      placement->warp_start[++placement->last_warp] = (uint32_t)placement->count;
}

struct layout;

// What a layout of one kind of ops (copy, synthetic) needs to know: the
// splitter's parameters, how an op is split, how a piece is written.
struct layout_kind {
  const char *ops_name;    // in messages: "copy", "synthetic"
  const char *pieces_name; // in messages: "descriptors", "pieces"
  uint64_t min_per_warp;   // units
  uint64_t piece_max;      // units
  uint64_t align;          // units
  // Splits op `op` (split_op with that op's shape).
  void (*split)(struct splitter *splitter, const struct layout *layout,
                size_t op);
  // Writes the piece the splitter emits into the layout's `out` at index
  // `placement.count`.
  void (*write)(const struct layout *layout, size_t op, uint64_t row,
                uint64_t rows, uint64_t column, uint64_t columns);
};

// Ops of one kind split into pieces: counted, and written when there is room
// for them.
struct layout {
  const struct layout_kind *kind;
  const ws_cuda_region *regions;
  const void *ops;
  void *out; // the pieces (NULL while counting)
  struct placement placement;
};

static void emit_piece(void *context, size_t op, uint64_t row, uint64_t rows,
                       uint64_t column, uint64_t columns, uint32_t warp) {
  struct layout *layout = context;
  if (layout->out != NULL)
    layout->kind->write(layout, op, row, rows, column, columns);
  place(&layout->placement, warp);
}

// Splits the layout's `count` ops (`total` units) over at most `warps` warps:
// writes the pieces to `out` and each warp's first piece to `warp_start`
// (both NULL: only counts them), and stores the warps used.
static void split_ops(struct layout *layout, size_t count, uint64_t total,
                      uint32_t warps, void *out, uint32_t *warp_start,
                      uint32_t *warps_used) {
  const struct layout_kind *kind = layout->kind;
  layout->out = out;
  layout->placement = (struct placement){0, warp_start, 0};
  if (warp_start != NULL)
    warp_start[0] = 0;
  struct splitter splitter;
  start_splitter(&splitter, total, kind->min_per_warp, warps, kind->piece_max,
                 kind->align, emit_piece, layout);
  for (size_t i = 0; i < count; i++)
    kind->split(&splitter, layout, i);
  finish_placement(&layout->placement, splitter.warps);
  *warps_used = splitter.warps;
}

// Lays `count` checked ops of `kind` (`total` units) out over at most `warps`
// warps: counts the pieces into `*piece_count` and the warps into
// `*warps_used`, then, with `out` (room for `capacity` pieces), writes the
// pieces there and each warp's first piece to `warp_start` (warps + 1).
static int lay_out(const struct layout_kind *kind,
                   const ws_cuda_region *regions, const void *ops,
                   size_t count, uint64_t total, uint32_t warps, void *out,
                   size_t capacity, size_t *piece_count, uint32_t *warp_start,
                   uint32_t *warps_used) {
  struct layout layout = {kind, regions, ops, NULL, {0, NULL, 0}};
  uint32_t used = 0;
  split_ops(&layout, count, total, warps, NULL, NULL, &used);
  size_t needed = layout.placement.count;
  if (needed > UINT32_MAX)
    return ws_fail(WS_EINVAL, "cuda: the %s ops make %zu %s", kind->ops_name,
                   needed, kind->pieces_name);
  *piece_count = needed;
  *warps_used = used;
  if (out == NULL)
    return WS_OK;
  if (capacity < needed || warp_start == NULL)
    return ws_fail(WS_EINVAL, "cuda: room for %zu %s, %zu needed", capacity,
                   kind->pieces_name, needed);
  split_ops(&layout, count, total, warps, out, warp_start, &used);
  return WS_OK;
}

// ---------------------------------------------------------------------------
// Copy ops

// True when an op's last row ends inside a region of `size` bytes (as in
// copy.c: rows must not overlap, and nothing may overflow).
static int fits(uint64_t offset, uint64_t rows, uint64_t width, uint64_t pitch,
                uint64_t size) {
  if (rows == 0 || width == 0)
    return offset <= size;
  if (rows > 1 && pitch < width)
    return 0;
  uint64_t last = rows - 1;
  if (pitch != 0 && last > (UINT64_MAX - width) / pitch)
    return 0;
  uint64_t span = last * pitch + width;
  return offset <= size && span <= size - offset;
}

static int check_regions(const ws_cuda_region *regions, size_t region_count) {
  for (size_t i = 0; i < region_count; i++)
    if (regions[i].pointer > UINT64_MAX - regions[i].size)
      return ws_fail(WS_EOVERFLOW, "cuda: region %zu: 0x%llx + %llu bytes "
                                   "overflows",
                     i, (unsigned long long)regions[i].pointer,
                     (unsigned long long)regions[i].size);
  return WS_OK;
}

// Checks what a plan's ops of either kind (`kind`: "copy", "synthetic") need
// before each is looked at: at most WS_CUDA_OPS_MAX of them, in an array, and
// regions that do not overflow.
static int check_op_list(const ws_cuda_region *regions, size_t region_count,
                         const void *ops, size_t count, const char *kind) {
  if (count > WS_CUDA_OPS_MAX)
    return ws_fail(WS_EINVAL, "cuda: %zu %s ops in one plan (at most %d)",
                   count, kind, WS_CUDA_OPS_MAX);
  if (count > 0 && ops == NULL)
    return ws_fail(WS_EINVAL, "cuda: %zu %s ops and no array", count, kind);
  return check_regions(regions, region_count);
}

static int check_copy_ops(const ws_cuda_region *regions, size_t region_count,
                          const ws_cuda_copy_op *ops, size_t count,
                          uint64_t *total) {
  int status = check_op_list(regions, region_count, ops, count, "copy");
  if (status != WS_OK)
    return status;
  *total = 0;
  for (size_t i = 0; i < count; i++) {
    const ws_cuda_copy_op *op = &ops[i];
    static const char *const roles[2] = {"target", "source"};
    const uint32_t indices[2] = {op->target_region, op->source_region};
    const uint64_t offsets[2] = {op->target_offset, op->source_offset};
    const uint64_t pitches[2] = {op->target_pitch, op->source_pitch};
    for (int side = 0; side < 2; side++) {
      if (indices[side] >= region_count)
        return ws_fail(WS_EINVAL, "cuda copy op %zu: %s region %u of %zu", i,
                       roles[side], indices[side], region_count);
      uint64_t size = regions[indices[side]].size;
      if (!fits(offsets[side], op->rows, op->width, pitches[side], size))
        return ws_fail(WS_EINVAL,
                       "cuda copy op %zu: %s [%llu, +%llu rows x %llu, pitch "
                       "%llu) exceeds region %u (%llu bytes)",
                       i, roles[side], (unsigned long long)offsets[side],
                       (unsigned long long)op->rows,
                       (unsigned long long)op->width,
                       (unsigned long long)pitches[side], indices[side],
                       (unsigned long long)size);
    }
    uint64_t bytes = op->rows * op->width; // fits() bounds it by the size
    if (op->width == 0)
      bytes = 0;
    if (bytes > UINT64_MAX - *total)
      return ws_fail(WS_EOVERFLOW, "cuda: the copy ops' bytes overflow");
    *total += bytes;
  }
  return WS_OK;
}

static int copy_contiguous(const ws_cuda_copy_op *op) {
  return op->target_pitch == op->width && op->source_pitch == op->width;
}

static void split_copy(struct splitter *splitter, const struct layout *layout,
                       size_t index) {
  const ws_cuda_copy_op *op = (const ws_cuda_copy_op *)layout->ops + index;
  uint64_t phase =
      (layout->regions[op->target_region].pointer + op->target_offset) & 15;
  split_op(splitter, index, op->rows, op->width, copy_contiguous(op), phase,
           op->target_pitch);
}

static void write_copy(const struct layout *layout, size_t op_index,
                       uint64_t row, uint64_t rows, uint64_t column,
                       uint64_t columns) {
  const ws_cuda_copy_op *op = (const ws_cuda_copy_op *)layout->ops + op_index;
  ws_cuda_copy_desc *desc =
      (ws_cuda_copy_desc *)layout->out + layout->placement.count;
  desc->source = layout->regions[op->source_region].pointer +
                 op->source_offset + row * op->source_pitch + column;
  desc->target = layout->regions[op->target_region].pointer +
                 op->target_offset + row * op->target_pitch + column;
  desc->rows = (uint32_t)rows;
  desc->width = (uint32_t)columns;
  desc->source_pitch = rows > 1 ? op->source_pitch : columns;
  desc->target_pitch = rows > 1 ? op->target_pitch : columns;
}

// Copy ops are cut in bytes, 16-byte aligned on the target.
static const struct layout_kind copy_pieces = {
    "copy",    "descriptors", WS_CUDA_WARP_MIN_BYTES, WS_CUDA_PIECE_MAX, 16,
    split_copy, write_copy};

int ws_cuda_copy_layout(const ws_cuda_region *regions, size_t region_count,
                        const ws_cuda_copy_op *ops, size_t count,
                        uint32_t warps, ws_cuda_copy_desc *descs,
                        size_t capacity, size_t *desc_count,
                        uint32_t *warp_start, uint32_t *warps_used) {
  ws_clear_error();
  uint64_t total = 0;
  int status = check_copy_ops(regions, region_count, ops, count, &total);
  if (status != WS_OK)
    return status;
  return lay_out(&copy_pieces, regions, ops, count, total, warps, descs,
                 capacity, desc_count, warp_start, warps_used);
}

// ---------------------------------------------------------------------------
// Bulk copies
//
// A model's canonical tensors often lie back to back on both sides (a packed
// expert tensor of the trainer and vLLM's fused expert weight hold the same
// bytes in the same order at TP 1): their ops join into one contiguous run,
// and a long run copies fastest as CUDA's own device-to-device copy, the
// flat copy that is the publication's floor. The kernel keeps the rest.

// The bytes of an op that is one contiguous stretch on both sides, or 0.
static uint64_t stretch_bytes(const ws_cuda_copy_op *op) {
  if (op->rows == 0 || op->width == 0)
    return 0;
  if (op->rows == 1 || copy_contiguous(op))
    return op->rows * op->width; // (check_copy_ops bounded it by a region)
  return 0;
}

// Orders ops by where they write (target region, then offset), then by where
// they read: ops that continue one another come next to each other whatever
// order the plan's tensors came in (a layer's experts down, gate, up, ...).
static int by_target(const void *a, const void *b) {
  const ws_cuda_copy_op *x = a, *y = b;
  if (x->target_region != y->target_region)
    return x->target_region < y->target_region ? -1 : 1;
  if (x->target_offset != y->target_offset)
    return x->target_offset < y->target_offset ? -1 : 1;
  if (x->source_region != y->source_region)
    return x->source_region < y->source_region ? -1 : 1;
  if (x->source_offset != y->source_offset)
    return x->source_offset < y->source_offset ? -1 : 1;
  return 0;
}

int ws_cuda_copy_split_bulk(const ws_cuda_region *regions, size_t region_count,
                            const ws_cuda_copy_op *given, size_t count,
                            uint64_t min_bytes, ws_cuda_copy_op *rest,
                            size_t *rest_count, ws_cuda_bulk_copy *bulk,
                            size_t *bulk_count) {
  ws_clear_error();
  uint64_t total = 0;
  int status = check_copy_ops(regions, region_count, given, count, &total);
  if (status != WS_OK)
    return status;
  if (count > 0 && (rest == NULL || bulk == NULL))
    return ws_fail(WS_EINVAL, "cuda: no room for the split of %zu ops", count);
  *rest_count = *bulk_count = 0;
  if (min_bytes == 0) {
    if (count > 0)
      memcpy(rest, given, count * sizeof *rest);
    *rest_count = count;
    return WS_OK;
  }
  ws_cuda_copy_op *ops = malloc((count > 0 ? count : 1) * sizeof *ops);
  if (ops == NULL)
    return ws_fail(WS_ENOMEM, "cuda: cannot order %zu copy ops", count);
  if (count > 0)
    memcpy(ops, given, count * sizeof *ops);
  qsort(ops, count, sizeof *ops, by_target);
  for (size_t i = 0; i < count;) {
    uint64_t run = stretch_bytes(&ops[i]);
    size_t next = i + 1;
    if (run != 0) {
      // (The ops that continue this one: same regions, each starting on both
      // sides where the run so far ends.)
      while (next < count) {
        const ws_cuda_copy_op *op = &ops[next];
        uint64_t bytes = stretch_bytes(op);
        if (bytes == 0 || op->target_region != ops[i].target_region ||
            op->source_region != ops[i].source_region ||
            op->target_offset != ops[i].target_offset + run ||
            op->source_offset != ops[i].source_offset + run)
          break;
        run += bytes;
        next++;
      }
    }
    if (run != 0 && run >= min_bytes) {
      bulk[*bulk_count] = (ws_cuda_bulk_copy){
          regions[ops[i].source_region].pointer + ops[i].source_offset,
          regions[ops[i].target_region].pointer + ops[i].target_offset, run};
      ++*bulk_count;
    } else if (run != 0) {
      ws_cuda_copy_op *joined = &rest[(*rest_count)++];
      *joined = ops[i];
      joined->rows = 1;
      joined->width = run;
      joined->target_pitch = joined->source_pitch = run;
    } else {
      rest[(*rest_count)++] = ops[i];
    }
    i = next;
  }
  free(ops);
  return WS_OK;
}

static int check_tile(uint64_t tile) {
  if (tile < WS_CUDA_TILE_UNIT || tile > WS_CUDA_TILE_MAX ||
      tile % WS_CUDA_TILE_UNIT != 0)
    return ws_fail(WS_EINVAL,
                   "cuda: a tile of %llu bytes (a multiple of %d up to %d)",
                   (unsigned long long)tile, WS_CUDA_TILE_UNIT,
                   WS_CUDA_TILE_MAX);
  return WS_OK;
}

// What every copy plan's creation checks first, with or without CUDA: the
// tile (0: per-warp ranges) and the ops, whose bytes it stores in `*total`.
static int check_copy_plan(const ws_cuda_region *regions, size_t region_count,
                           const ws_cuda_copy_op *ops, size_t count,
                           uint64_t tile, uint64_t *total) {
  ws_clear_error();
  int status = tile != 0 ? check_tile(tile) : WS_OK;
  if (status == WS_OK)
    status = check_copy_ops(regions, region_count, ops, count, total);
  return status;
}

int ws_cuda_copy_tile_layout(const ws_cuda_region *regions,
                             size_t region_count, const ws_cuda_copy_op *ops,
                             size_t count, ws_cuda_copy_desc *descs,
                             size_t capacity, size_t *desc_count,
                             uint64_t *starts) {
  // (One warp's layout: every op in stream order, cut only at the
  // descriptor size limit.)
  uint32_t one = 0;
  int status = ws_cuda_copy_layout(regions, region_count, ops, count, 1, NULL,
                                   0, desc_count, NULL, &one);
  if (status != WS_OK || descs == NULL)
    return status;
  if (starts == NULL)
    return ws_fail(WS_EINVAL, "cuda: a tiled layout needs its starts");
  uint32_t warp_start[2];
  status = ws_cuda_copy_layout(regions, region_count, ops, count, 1, descs,
                               capacity, desc_count, warp_start, &one);
  if (status != WS_OK)
    return status;
  starts[0] = 0;
  for (size_t i = 0; i < *desc_count; i++)
    starts[i + 1] = starts[i] + (uint64_t)descs[i].rows * descs[i].width;
  return WS_OK;
}

int ws_cuda_copy_tiles_on_host(const ws_cuda_copy_desc *descs,
                               const uint64_t *starts, size_t count,
                               uint64_t tile, uint32_t warps) {
  ws_clear_error();
  int status = check_tile(tile);
  if (status != WS_OK)
    return status;
  if (warps == 0 || (count > 0 && (descs == NULL || starts == NULL)))
    return ws_fail(WS_EINVAL, "cuda: no warps or no descriptors to walk");
  const uint64_t total = starts != NULL ? starts[count] : 0;
  for (uint32_t warp = 0; warp < warps; warp++) {
    size_t cursor = 0;
    for (uint64_t begin = (uint64_t)warp * tile; begin < total;
         begin += (uint64_t)warps * tile) {
      uint64_t end = begin + tile < total ? begin + tile : total;
      while (cursor + 1 < count && starts[cursor + 1] <= begin)
        cursor++;
      for (size_t i = cursor; i < count && starts[i] < end; i++) {
        uint64_t from = begin > starts[i] ? begin - starts[i] : 0;
        uint64_t to = (end < starts[i + 1] ? end : starts[i + 1]) - starts[i];
        ws_cuda_copy_desc parts[3];
        unsigned n = ws_cuda_tile_parts(&descs[i], from, to, parts);
        for (unsigned p = 0; p < n; p++)
          for (uint32_t row = 0; row < parts[p].rows; row++)
            memmove((char *)(uintptr_t)(parts[p].target +
                                        row * parts[p].target_pitch),
                    (const char *)(uintptr_t)(parts[p].source +
                                              row * parts[p].source_pitch),
                    parts[p].width);
      }
    }
  }
  return WS_OK;
}

// ---------------------------------------------------------------------------
// Synthetic ops

// The largest tensor element index a check can report (op << 40 | element).
static const uint64_t ELEMENT_LIMIT = (uint64_t)1 << WS_CUDA_CHECK_ELEMENT_BITS;

static int check_synth_ops(const ws_cuda_region *regions, size_t region_count,
                           const ws_cuda_synth_op *ops, size_t count,
                           uint64_t *total_elements, uint64_t *total_bytes) {
  int status = check_op_list(regions, region_count, ops, count, "synthetic");
  if (status != WS_OK)
    return status;
  *total_elements = 0;
  *total_bytes = 0;
  for (size_t i = 0; i < count; i++) {
    const ws_cuda_synth_op *op = &ops[i];
    if (op->dtype != WS_DTYPE_BFLOAT16 && op->dtype != WS_DTYPE_FLOAT32) {
      const char *name = ws_dtype_name((ws_dtype)op->dtype);
      return ws_fail(WS_EINVAL,
                     "cuda synthetic op %zu: dtype %s is not generated "
                     "(bfloat16, float32)",
                     i, name != NULL ? name : "?");
    }
    if (op->region >= region_count)
      return ws_fail(WS_EINVAL, "cuda synthetic op %zu: region %u of %zu", i,
                     op->region, region_count);
    uint64_t size = ws_dtype_size((ws_dtype)op->dtype);
    if (op->row_elements > UINT64_MAX / size)
      return ws_fail(WS_EOVERFLOW, "cuda synthetic op %zu: row overflows", i);
    uint64_t width = op->row_elements * size;
    const ws_cuda_region *region = &regions[op->region];
    if (!fits(op->offset, op->rows, width, op->target_pitch, region->size))
      return ws_fail(WS_EINVAL,
                     "cuda synthetic op %zu: [%llu, +%llu rows x %llu, pitch "
                     "%llu) exceeds region %u (%llu bytes)",
                     i, (unsigned long long)op->offset,
                     (unsigned long long)op->rows, (unsigned long long)width,
                     (unsigned long long)op->target_pitch, op->region,
                     (unsigned long long)region->size);
    if ((region->pointer + op->offset) % size != 0 ||
        (op->rows > 1 && op->target_pitch % size != 0))
      return ws_fail(WS_EINVAL,
                     "cuda synthetic op %zu: offset %llu or pitch %llu is not "
                     "a multiple of the %llu-byte element",
                     i, (unsigned long long)op->offset,
                     (unsigned long long)op->target_pitch,
                     (unsigned long long)size);
    uint64_t elements = op->rows * op->row_elements;
    if (elements == 0)
      continue;
    uint64_t last_row = op->rows - 1;
    if (op->first >= ELEMENT_LIMIT || op->row_elements > ELEMENT_LIMIT ||
        (last_row > 0 && op->element_pitch > ELEMENT_LIMIT / last_row) ||
        op->first + last_row * op->element_pitch + op->row_elements >
            ELEMENT_LIMIT)
      return ws_fail(WS_EINVAL,
                     "cuda synthetic op %zu: tensor elements past 2^%d", i,
                     WS_CUDA_CHECK_ELEMENT_BITS);
    if (elements > UINT64_MAX - *total_elements)
      return ws_fail(WS_EOVERFLOW, "cuda: the synthetic ops overflow");
    *total_elements += elements;
    *total_bytes += elements * size;
  }
  return WS_OK;
}

#ifdef WSYNC_WITH_CUDA
static int synth_contiguous(const ws_cuda_synth_op *op) {
  return op->target_pitch ==
             op->row_elements * ws_dtype_size((ws_dtype)op->dtype) &&
         op->element_pitch == op->row_elements;
}

static void split_synth(struct splitter *splitter, const struct layout *layout,
                        size_t index) {
  const ws_cuda_synth_op *op = (const ws_cuda_synth_op *)layout->ops + index;
  split_op(splitter, index, op->rows, op->row_elements, synth_contiguous(op), 0,
           0);
}

static void write_synth(const struct layout *layout, size_t op_index,
                        uint64_t row, uint64_t rows, uint64_t column,
                        uint64_t columns) {
  const ws_cuda_synth_op *op = (const ws_cuda_synth_op *)layout->ops + op_index;
  uint64_t size = ws_dtype_size((ws_dtype)op->dtype);
  ws_cuda_synth_piece *piece =
      (ws_cuda_synth_piece *)layout->out + layout->placement.count;
  piece->target = layout->regions[op->region].pointer + op->offset +
                  row * op->target_pitch + column * size;
  piece->seed = op->seed;
  piece->first = op->first + row * op->element_pitch + column;
  piece->target_pitch = op->target_pitch;
  piece->element_pitch = op->element_pitch;
  piece->rows = (uint32_t)rows;
  piece->row_elements = (uint32_t)columns;
  piece->op = (uint32_t)op_index;
  piece->element_bytes = (uint32_t)size;
}

// Synthetic ops are cut in elements.
static const struct layout_kind synth_pieces = {
    "synthetic", "pieces",   WS_CUDA_WARP_MIN_BYTES / 2, WS_CUDA_PIECE_MAX / 4,
    1,           split_synth, write_synth};
#endif

// ---------------------------------------------------------------------------
// FP8 ops
//
// An FP8 transform's ops are checked as the host's reference checks them
// (ws_fp8_check, the regions standing for targets and sources alike), then
// cut into pieces of at most WS_CUDA_FP8_PIECE_ELEMENTS elements: whole rows
// of an op whose rows are narrower, otherwise parts of one row (cut at
// multiples of the limit, so that a piece keeps its op's alignment).

static int check_fp8_ops(const ws_cuda_region *regions, size_t region_count,
                         const ws_fp8_group *groups, size_t group_count,
                         const ws_fp8_op *ops, size_t count) {
  int status = check_op_list(regions, region_count, ops, count, "fp8");
  if (status != WS_OK)
    return status;
  size_t *sizes = malloc((region_count > 0 ? region_count : 1) * sizeof *sizes);
  if (sizes == NULL)
    return ws_fail(WS_ENOMEM, "cuda: %zu regions", region_count);
  for (size_t i = 0; i < region_count; i++)
    sizes[i] = (size_t)regions[i].size;
  status = ws_fp8_check(sizes, region_count, sizes, region_count, groups,
                        group_count, ops, count);
  free(sizes);
  if (status != WS_OK)
    return status;
  for (size_t g = 0; g < group_count; g++)
    if ((regions[groups[g].target].pointer + groups[g].scale_offset) % 4 != 0)
      return ws_fail(WS_EINVAL, "cuda fp8 group %zu: its float32 scale at byte "
                                "%llu of region %llu is not 4-byte aligned",
                     g, (unsigned long long)groups[g].scale_offset,
                     (unsigned long long)groups[g].target);
  for (size_t i = 0; i < count; i++)
    if ((regions[ops[i].source].pointer + ops[i].source_offset) % 2 != 0 ||
        (ops[i].rows > 1 && ops[i].source_pitch % 2 != 0))
      return ws_fail(WS_EINVAL, "cuda fp8 op %zu: its bfloat16 source (byte "
                                "%llu of region %llu, pitch %llu) is not "
                                "2-byte aligned",
                     i, (unsigned long long)ops[i].source_offset,
                     (unsigned long long)ops[i].source,
                     (unsigned long long)ops[i].source_pitch);
  return WS_OK;
}

int ws_cuda_fp8_layout(const ws_cuda_region *regions, size_t region_count,
                       const ws_fp8_group *groups, size_t group_count,
                       const ws_fp8_op *ops, size_t count,
                       ws_cuda_fp8_piece *pieces, size_t capacity,
                       size_t *piece_count) {
  ws_clear_error();
  int status =
      check_fp8_ops(regions, region_count, groups, group_count, ops, count);
  if (status != WS_OK)
    return status;
  const uint64_t limit = WS_CUDA_FP8_PIECE_ELEMENTS;
  size_t made = 0;
  for (size_t i = 0; i < count; i++) {
    const ws_fp8_op *op = &ops[i];
    if (op->rows == 0 || op->columns == 0)
      continue;
    uint64_t rows_per_piece = op->columns >= limit ? 1 : limit / op->columns;
    for (uint64_t row = 0; row < op->rows; row += rows_per_piece) {
      uint64_t rows = min_u64(rows_per_piece, op->rows - row);
      for (uint64_t column = 0; column < op->columns; column += limit) {
        if (pieces != NULL) {
          if (made >= capacity)
            return ws_fail(WS_EINVAL, "cuda: room for %zu fp8 pieces",
                           capacity);
          ws_cuda_fp8_piece *piece = &pieces[made];
          piece->source = regions[op->source].pointer + op->source_offset +
                          row * op->source_pitch + column * 2;
          piece->target = regions[op->target].pointer + op->target_offset +
                          row * op->target_pitch + column;
          piece->source_pitch = op->source_pitch;
          piece->target_pitch = op->target_pitch;
          piece->rows = (uint32_t)rows;
          piece->columns = (uint32_t)min_u64(limit, op->columns - column);
          piece->group = (uint32_t)op->group;
          piece->op = (uint32_t)(i < UINT32_MAX ? i : UINT32_MAX);
        }
        made++;
      }
    }
  }
  if (made > UINT32_MAX)
    return ws_fail(WS_EINVAL, "cuda: the fp8 ops make %zu pieces", made);
  *piece_count = made;
  return WS_OK;
}

// ---------------------------------------------------------------------------
// Plans on a device

// What every plan holds: its device memory and what one launch does.
struct plan_core {
  int device;
  void *memory; // the plan's own layout (see each plan)
  size_t memory_bytes;
  uint32_t warps;
  size_t pieces;
  size_t ops;
  uint64_t bytes;
};

struct ws_cuda_copy_plan {
  // memory: descriptors, then warp_start (tiled: their starts)
  struct plan_core core;
  uint64_t tile; // 0: per-warp ranges
  ws_cuda_bulk_copy *bulk; // (host memory) queued before the kernel
  size_t bulk_count;
  uint64_t bulk_bytes;
};

struct ws_cuda_fp8_plan {
  // memory: pieces, then the groups' scale addresses, then their amax
  struct plan_core core;
  size_t groups;
};

struct ws_cuda_synth_plan {
  // memory: check state, pieces, then warp_start
  struct plan_core core;
  ws_cuda_check_state *host_state; // pinned
  void *checked;                   // cudaEvent_t after the last check
  int check_queued;
};

// (A plan's core comes first: a pointer to the plan points to its core.)
_Static_assert(offsetof(ws_cuda_copy_plan, core) == 0, "core first");
_Static_assert(offsetof(ws_cuda_fp8_plan, core) == 0, "core first");
_Static_assert(offsetof(ws_cuda_synth_plan, core) == 0, "core first");

static void describe(ws_cuda_plan_info *out, const struct plan_core *core) {
  out->tile = 0;
  out->ops = core->ops;
  out->pieces = core->pieces;
  out->warps = core->warps;
  out->blocks = ((uint64_t)core->warps * WS_CUDA_WARP + WS_CUDA_THREADS - 1) /
                WS_CUDA_THREADS;
  out->bytes = core->bytes;
  out->device_bytes = core->memory_bytes;
  out->bulk = out->bulk_bytes = 0;
}

void ws_cuda_copy_plan_info(const ws_cuda_copy_plan *plan,
                            ws_cuda_plan_info *out) {
  describe(out, &plan->core);
  out->tile = plan->tile;
  out->bulk = plan->bulk_count;
  out->bulk_bytes = plan->bulk_bytes;
}

void ws_cuda_synth_plan_info(const ws_cuda_synth_plan *plan,
                             ws_cuda_plan_info *out) {
  describe(out, &plan->core);
}

void ws_cuda_fp8_plan_info(const ws_cuda_fp8_plan *plan,
                           ws_cuda_plan_info *out) {
  describe(out, &plan->core);
}

#ifdef WSYNC_WITH_CUDA

// Checks the regions the ops use (device memory of `device`, inside one
// allocation each).
static int check_used_regions(const ws_cuda_region *regions,
                              size_t region_count, const unsigned char *used,
                              int device) {
  for (size_t i = 0; i < region_count; i++) {
    if (!used[i])
      continue;
    int status = ws_cuda_check_region(&regions[i], device, "region", i);
    if (status != WS_OK)
      return status;
  }
  return WS_OK;
}

// Uploads `bytes` of `host` into fresh device memory and waits for it.
static int upload(const void *host, size_t bytes, void **out,
                  const char *what) {
  void *memory = NULL;
  int status = ws_cuda_allocate(bytes, &memory, what);
  if (status != WS_OK)
    return status;
  cudaError_t error =
      cudaMemcpyAsync(memory, host, bytes, cudaMemcpyHostToDevice, 0);
  if (error != cudaSuccess)
    status = ws_cuda_failure(error, "cudaMemcpyAsync", "uploading %s", what);
  else
    status = ws_cuda_wait(NULL, NULL, what);
  if (status != WS_OK) {
    ws_cuda_release(memory, bytes, what);
    return status;
  }
  *out = memory;
  return WS_OK;
}

// Uploads a plan's device memory, laid out in `bytes` at `host`, and records
// what the plan holds (`what` names the memory).
static int finish_plan(struct plan_core *core, int device, const void *host,
                       size_t bytes, uint32_t warps, size_t pieces, size_t ops,
                       uint64_t total, const char *what) {
  void *memory = NULL;
  int status = upload(host, bytes, &memory, what);
  if (status == WS_OK)
    *core = (struct plan_core){device, memory, bytes, warps, pieces, ops, total};
  return status;
}

static size_t round_up(size_t value, size_t to) {
  return (value + to - 1) / to * to;
}

// What a plan's creation holds until it hands the plan out: the caller's
// device, the plan object, which regions the ops use, and the host copy of
// the plan's device memory.
struct creation {
  int previous;
  void *plan;
  unsigned char *used;
  void *host;
};

// Ends a plan's creation: a plan it still holds (not handed out) is dropped,
// `discard` (NULL: none) first releasing what that plan holds while the device
// is current; then the caller's device is made current again and the rest is
// freed. Returns `status`.
static int finish_creation(struct creation *creation, int status,
                           void (*discard)(void *plan)) {
  if (creation->plan != NULL && discard != NULL)
    discard(creation->plan);
  ws_cuda_leave(creation->previous);
  free(creation->host);
  free(creation->used);
  free(creation->plan);
  return status;
}

// Starts a plan's creation on `device` once its arguments pass their check
// (`*status`, the check's result: a failure returns at once): makes the device
// current, then allocates the zeroed plan object (`plan_bytes`), the flags of
// the regions the ops use and (`host_bytes` > 0) a zeroed host copy of the
// plan's device memory. Returns the plan, or NULL with the failure in
// `*status` and nothing held (`what` names the plan for ENOMEM).
static void *start_creation(struct creation *creation, int *status, int device,
                            size_t plan_bytes, size_t region_count,
                            size_t host_bytes, const char *what) {
  *creation = (struct creation){0, NULL, NULL, NULL};
  if (*status != WS_OK)
    return NULL;
  *status = ws_cuda_enter(device, &creation->previous);
  if (*status != WS_OK)
    return NULL;
  creation->plan = calloc(1, plan_bytes);
  creation->used = calloc(region_count > 0 ? region_count : 1, 1);
  if (host_bytes > 0)
    creation->host = calloc(1, host_bytes);
  if (creation->plan == NULL || creation->used == NULL ||
      (host_bytes > 0 && creation->host == NULL)) {
    *status = finish_creation(
        creation, ws_fail(WS_ENOMEM, "cuda: cannot allocate %s", what), NULL);
    return NULL;
  }
  return creation->plan;
}

// Lays the ops out (per-warp ranges, or tiles of `tile` bytes) into host
// memory as the plan's device memory holds them. Returns the bytes in *out
// (freed by the caller), the descriptor count and the warps of a launch.
static int lay_out_copies(const ws_cuda_region *regions, size_t region_count,
                          const ws_cuda_copy_op *ops, size_t count,
                          uint32_t capacity, uint64_t tile, void **out,
                          size_t *out_bytes, size_t *pieces,
                          uint32_t *warps) {
  int status = tile != 0
                   ? ws_cuda_copy_tile_layout(regions, region_count, ops, count,
                                              NULL, 0, pieces, NULL)
                   : ws_cuda_copy_layout(regions, region_count, ops, count,
                                         capacity, NULL, 0, pieces, NULL, warps);
  if (status != WS_OK)
    return status;
  size_t desc_bytes = round_up(*pieces * sizeof(ws_cuda_copy_desc), 16);
  size_t bytes = desc_bytes + (tile != 0
                                   ? (*pieces + 1) * sizeof(uint64_t)
                                   : ((size_t)*warps + 1) * sizeof(uint32_t));
  void *host = malloc(bytes);
  if (host == NULL)
    return ws_fail(WS_ENOMEM, "cuda: cannot allocate %zu bytes of "
                              "descriptors", bytes);
  void *after = (char *)host + desc_bytes;
  if (tile != 0) {
    status = ws_cuda_copy_tile_layout(regions, region_count, ops, count, host,
                                      *pieces, pieces, after);
    *warps = capacity; // (every warp the device holds takes tiles in turn)
  } else {
    status = ws_cuda_copy_layout(regions, region_count, ops, count, capacity,
                                 host, *pieces, pieces, after, warps);
  }
  if (status != WS_OK) {
    free(host);
    return status;
  }
  *out = host;
  *out_bytes = bytes;
  return WS_OK;
}

// Frees a copy plan's bulk copies (host memory).
static void free_bulk(void *plan_object) {
  ws_cuda_copy_plan *plan = plan_object;
  free(plan->bulk);
}

static int create_copy_plan(int device, const ws_cuda_region *regions,
                            size_t region_count, const ws_cuda_copy_op *ops,
                            size_t count, uint64_t tile, uint64_t bulk_min,
                            ws_cuda_copy_plan **out) {
  struct creation creation;
  uint64_t total = 0;
  int status =
      check_copy_plan(regions, region_count, ops, count, tile, &total);
  ws_cuda_copy_plan *plan =
      start_creation(&creation, &status, device, sizeof *plan, region_count, 0,
                     "a copy plan");
  if (plan == NULL)
    return status;
  ws_cuda_copy_op *rest = calloc(count > 0 ? count : 1, sizeof *rest);
  if (rest == NULL ||
      (plan->bulk = calloc(count > 0 ? count : 1, sizeof *plan->bulk)) ==
          NULL) {
    status = ws_fail(WS_ENOMEM, "cuda: cannot allocate a copy plan");
    goto done;
  }
  for (size_t i = 0; i < count; i++)
    if (ops[i].rows != 0 && ops[i].width != 0)
      creation.used[ops[i].target_region] =
          creation.used[ops[i].source_region] = 1;
  status = check_used_regions(regions, region_count, creation.used, device);
  if (status != WS_OK)
    goto done;
  size_t rest_count = 0;
  status = ws_cuda_copy_split_bulk(regions, region_count, ops, count, bulk_min,
                                   rest, &rest_count, plan->bulk,
                                   &plan->bulk_count);
  if (status != WS_OK)
    goto done;
  for (size_t i = 0; i < plan->bulk_count; i++)
    plan->bulk_bytes += plan->bulk[i].bytes;
  if (plan->bulk_count < count) { // (keep what the launches read)
    ws_cuda_bulk_copy *kept = realloc(
        plan->bulk, (plan->bulk_count > 0 ? plan->bulk_count : 1) *
                        sizeof *plan->bulk);
    if (kept != NULL)
      plan->bulk = kept;
  }
  uint32_t capacity = 0, synth_capacity = 0;
  status = ws_cuda_kernel_capacity(device, &capacity, &synth_capacity);
  if (status != WS_OK)
    goto done;
  size_t pieces = 0, bytes = 0;
  uint32_t warps = 0;
  status = lay_out_copies(regions, region_count, rest, rest_count, capacity,
                          tile, &creation.host, &bytes, &pieces, &warps);
  if (status == WS_OK)
    status = finish_plan(&plan->core, device, creation.host, bytes, warps,
                         pieces, count, total, "copy plan descriptors");
  if (status != WS_OK)
    goto done;
  plan->tile = tile;
  *out = plan;
  creation.plan = NULL;
done:
  free(rest);
  return finish_creation(&creation, status, free_bulk);
}

int ws_cuda_copy_plan_launch(ws_cuda_copy_plan *plan, ws_cuda_stream *stream) {
  ws_clear_error();
  void *raw = NULL;
  int status = ws_cuda_stream_for(stream, plan->core.device, &raw);
  if (status != WS_OK || (plan->core.pieces == 0 && plan->bulk_count == 0))
    return status;
  int previous = 0;
  status = ws_cuda_enter(plan->core.device, &previous);
  if (status != WS_OK)
    return status;
  for (size_t i = 0; i < plan->bulk_count; i++) {
    const ws_cuda_bulk_copy *copy = &plan->bulk[i];
    cudaError_t error = cudaMemcpyAsync(
        (void *)(uintptr_t)copy->target, (const void *)(uintptr_t)copy->source,
        copy->bytes, cudaMemcpyDeviceToDevice, (cudaStream_t)raw);
    if (error != cudaSuccess) {
      ws_cuda_leave(previous);
      return ws_cuda_failure(error, "cudaMemcpyAsync",
                             "bulk copy %zu of %zu (%llu bytes) of a copy "
                             "plan on device %d",
                             i, plan->bulk_count,
                             (unsigned long long)copy->bytes,
                             plan->core.device);
    }
  }
  const struct plan_core *core = &plan->core;
  if (core->pieces == 0) {
    ws_cuda_leave(previous);
    return WS_OK;
  }
  size_t desc_bytes = round_up(core->pieces * sizeof(ws_cuda_copy_desc), 16);
  const ws_cuda_copy_desc *descs = core->memory;
  const void *after = (const char *)core->memory + desc_bytes;
  int error = plan->tile != 0
                  ? ws_cuda_launch_copy_tiles(descs, after,
                                              (uint32_t)core->pieces,
                                              plan->tile, core->warps, raw)
                  : ws_cuda_launch_copy(descs, after, core->warps, raw);
  ws_cuda_leave(previous);
  if (error != cudaSuccess)
    return ws_cuda_failure(error, "cudaLaunchKernel",
                           "copy plan of %zu ops (%zu descriptors) on device %d",
                           core->ops, core->pieces, core->device);
  ws_cuda_count_launch();
  return WS_OK;
}

// Closes a plan (NULL: nothing to close) on its device: `release_extra`
// (NULL: none) what it holds besides its device memory, then that memory
// (`what` names it), then the object.
static int close_plan(void *plan, void (*release_extra)(void *plan),
                      const char *what) {
  ws_clear_error();
  if (plan == NULL)
    return WS_OK;
  const struct plan_core *core = plan; // (every plan begins with its core)
  int previous = 0;
  int status = ws_cuda_enter(core->device, &previous);
  if (status == WS_OK) {
    if (release_extra != NULL)
      release_extra(plan);
    status = ws_cuda_release(core->memory, core->memory_bytes, what);
    ws_cuda_leave(previous);
  }
  free(plan);
  return status;
}

int ws_cuda_copy_plan_close(ws_cuda_copy_plan *plan) {
  if (plan != NULL)
    free_bulk(plan);
  return close_plan(plan, NULL, "copy plan descriptors");
}

// Frees a synthetic plan's check state: its event and pinned memory.
static void release_check_state(void *plan_object) {
  ws_cuda_synth_plan *plan = plan_object;
  if (plan->checked != NULL)
    cudaEventDestroy((cudaEvent_t)plan->checked);
  if (plan->host_state != NULL)
    cudaFreeHost(plan->host_state);
}

// Drops a synthetic plan that was not handed out: its check state and its
// device memory.
static void discard_synth_plan(void *plan_object) {
  ws_cuda_synth_plan *plan = plan_object;
  release_check_state(plan);
  ws_cuda_release(plan->core.memory, plan->core.memory_bytes,
                  "synthetic plan pieces");
}

int ws_cuda_synth_plan_create(int device, const ws_cuda_region *regions,
                              size_t region_count, const ws_cuda_synth_op *ops,
                              size_t count, ws_cuda_synth_plan **out) {
  ws_clear_error();
  struct creation creation;
  uint64_t elements = 0, total_bytes = 0;
  int status = check_synth_ops(regions, region_count, ops, count, &elements,
                               &total_bytes);
  ws_cuda_synth_plan *plan =
      start_creation(&creation, &status, device, sizeof *plan, region_count, 0,
                     "a synthetic plan");
  if (plan == NULL)
    return status;
  for (size_t i = 0; i < count; i++)
    if (ops[i].rows != 0 && ops[i].row_elements != 0)
      creation.used[ops[i].region] = 1;
  status = check_used_regions(regions, region_count, creation.used, device);
  if (status != WS_OK)
    goto done;
  uint32_t copy_capacity = 0, capacity = 0;
  status = ws_cuda_kernel_capacity(device, &copy_capacity, &capacity);
  if (status != WS_OK)
    goto done;
  size_t pieces = 0;
  uint32_t warps = 0;
  status = lay_out(&synth_pieces, regions, ops, count, elements, capacity, NULL,
                   0, &pieces, NULL, &warps);
  if (status != WS_OK)
    goto done;
  size_t state_bytes = round_up(sizeof(ws_cuda_check_state), 16);
  size_t piece_bytes = round_up(pieces * sizeof(ws_cuda_synth_piece), 16);
  size_t bytes = state_bytes + piece_bytes + ((size_t)warps + 1) * 4;
  char *host = creation.host = calloc(1, bytes);
  if (host == NULL) {
    status = ws_fail(WS_ENOMEM, "cuda: cannot allocate %zu bytes of pieces",
                     bytes);
    goto done;
  }
  uint32_t *warp_start = (uint32_t *)(host + state_bytes + piece_bytes);
  status = lay_out(&synth_pieces, regions, ops, count, elements, capacity,
                   host + state_bytes, pieces, &pieces, warp_start, &warps);
  if (status == WS_OK)
    status = finish_plan(&plan->core, device, host, bytes, warps, pieces, count,
                         total_bytes, "synthetic plan pieces");
  if (status != WS_OK)
    goto done;
  cudaError_t error = cudaMallocHost((void **)&plan->host_state,
                                     sizeof *plan->host_state);
  if (error != cudaSuccess) {
    status = ws_cuda_failure(error, "cudaMallocHost", "synthetic plan state");
    goto done;
  }
  cudaEvent_t checked = NULL;
  error = cudaEventCreateWithFlags(&checked, cudaEventBlockingSync |
                                                 cudaEventDisableTiming);
  if (error != cudaSuccess) {
    status = ws_cuda_failure(error, "cudaEventCreateWithFlags",
                             "synthetic plan");
    goto done;
  }
  plan->checked = checked;
  *out = plan;
  creation.plan = NULL;
done:
  return finish_creation(&creation, status, discard_synth_plan);
}

static int launch_synth(ws_cuda_synth_plan *plan, uint32_t version,
                        ws_cuda_stream *stream, int check) {
  ws_clear_error();
  void *raw = NULL;
  int previous = 0;
  const struct plan_core *core = &plan->core;
  int status = ws_cuda_enter_stream(stream, core->device, &raw, &previous);
  if (status != WS_OK)
    return status;
  ws_cuda_check_state *state = core->memory;
  size_t state_bytes = round_up(sizeof(ws_cuda_check_state), 16);
  size_t piece_bytes = round_up(core->pieces * sizeof(ws_cuda_synth_piece), 16);
  const ws_cuda_synth_piece *pieces =
      (const ws_cuda_synth_piece *)((const char *)core->memory + state_bytes);
  const uint32_t *warp_start =
      (const uint32_t *)((const char *)core->memory + state_bytes +
                         piece_bytes);
  cudaStream_t cuda_stream = (cudaStream_t)raw;
  const char *call = "cudaMemsetAsync";
  cudaError_t error = cudaSuccess;
  if (check) {
    error = cudaMemsetAsync(&state->mismatches, 0, sizeof state->mismatches,
                            cuda_stream);
    if (error == cudaSuccess)
      error = cudaMemsetAsync(&state->first, 0xff, sizeof state->first,
                              cuda_stream);
  }
  if (error == cudaSuccess && core->pieces > 0) {
    call = "cudaLaunchKernel";
    error = ws_cuda_launch_synth(pieces, warp_start, core->warps, version,
                                 check, state, raw);
    if (error == cudaSuccess)
      ws_cuda_count_launch();
  }
  if (error == cudaSuccess && check) {
    call = "cudaMemcpyAsync";
    error = cudaMemcpyAsync(plan->host_state, state, sizeof *state,
                            cudaMemcpyDeviceToHost, cuda_stream);
    if (error == cudaSuccess) {
      call = "cudaEventRecord";
      error = cudaEventRecord((cudaEvent_t)plan->checked, cuda_stream);
    }
    plan->check_queued = error == cudaSuccess;
  }
  ws_cuda_leave(previous);
  if (error != cudaSuccess)
    return ws_cuda_failure(error, call,
                           "synthetic %s of %zu ops on device %d",
                           check ? "check" : "fill", core->ops, core->device);
  return WS_OK;
}

int ws_cuda_synth_plan_result(ws_cuda_synth_plan *plan,
                              ws_cuda_synth_result *out) {
  ws_clear_error();
  if (!plan->check_queued)
    return ws_fail(WS_ESTATE, "cuda: no synthetic check was queued");
  cudaError_t error = cudaEventSynchronize((cudaEvent_t)plan->checked);
  if (error != cudaSuccess)
    return ws_cuda_failure(error, "cudaEventSynchronize",
                           "synthetic check on device %d", plan->core.device);
  out->mismatches = plan->host_state->mismatches;
  uint64_t first = plan->host_state->first;
  if (out->mismatches == 0) {
    out->first_op = 0;
    out->first_element = 0;
  } else {
    out->first_op = first >> WS_CUDA_CHECK_ELEMENT_BITS;
    out->first_element = first & (ELEMENT_LIMIT - 1);
  }
  return WS_OK;
}

int ws_cuda_synth_plan_close(ws_cuda_synth_plan *plan) {
  return close_plan(plan, release_check_state, "synthetic plan pieces");
}


// The bytes of an FP8 plan's device memory: its pieces, then the groups'
// scale addresses (uint64_t), then their amax (float32 bits).
static size_t fp8_memory_bytes(size_t pieces, size_t groups,
                               size_t *scales_at, size_t *amax_at) {
  *scales_at = round_up(pieces * sizeof(ws_cuda_fp8_piece), 16);
  *amax_at = *scales_at + round_up(groups * sizeof(uint64_t), 16);
  return *amax_at + round_up((groups > 0 ? groups : 1) * sizeof(uint32_t), 16);
}

int ws_cuda_fp8_plan_create(int device, const ws_cuda_region *regions,
                            size_t region_count, const ws_fp8_group *groups,
                            size_t group_count, const ws_fp8_op *ops,
                            size_t count, ws_cuda_fp8_plan **out) {
  struct creation creation;
  size_t pieces = 0;
  int status = ws_cuda_fp8_layout(regions, region_count, groups, group_count,
                                  ops, count, NULL, 0, &pieces);
  size_t scales_at = 0, amax_at = 0;
  size_t bytes = fp8_memory_bytes(pieces, group_count, &scales_at, &amax_at);
  ws_cuda_fp8_plan *plan =
      start_creation(&creation, &status, device, sizeof *plan, region_count,
                     bytes, "an fp8 plan");
  if (plan == NULL)
    return status;
  unsigned char *used = creation.used;
  char *host = creation.host;
  uint64_t written = 4 * (uint64_t)group_count;
  for (size_t i = 0; i < count; i++) {
    used[ops[i].target] = used[ops[i].source] = 1;
    written += ops[i].rows * ops[i].columns;
  }
  for (size_t g = 0; g < group_count; g++) {
    used[groups[g].target] = 1;
    ((uint64_t *)(host + scales_at))[g] =
        regions[groups[g].target].pointer + groups[g].scale_offset;
  }
  status = check_used_regions(regions, region_count, used, device);
  if (status == WS_OK)
    status = ws_cuda_fp8_layout(regions, region_count, groups, group_count,
                                ops, count, (ws_cuda_fp8_piece *)host, pieces,
                                &pieces);
  uint32_t capacity = 0, synth_capacity = 0;
  if (status == WS_OK)
    status = ws_cuda_kernel_capacity(device, &capacity, &synth_capacity);
  uint32_t warps = (uint32_t)min_u64(
      capacity, pieces > group_count
                    ? pieces
                    : (group_count + WS_CUDA_WARP - 1) / WS_CUDA_WARP);
  if (warps == 0)
    warps = 1;
  if (status == WS_OK)
    status = finish_plan(&plan->core, device, host, bytes, warps, pieces, count,
                         written, "fp8 plan pieces");
  if (status != WS_OK)
    goto done;
  plan->groups = group_count;
  *out = plan;
  creation.plan = NULL;
done:
  return finish_creation(&creation, status, NULL);
}

int ws_cuda_fp8_plan_launch(ws_cuda_fp8_plan *plan, ws_cuda_stream *stream) {
  ws_clear_error();
  void *raw = NULL;
  const struct plan_core *core = &plan->core;
  int status = ws_cuda_stream_for(stream, core->device, &raw);
  if (status != WS_OK || plan->groups == 0)
    return status;
  int previous = 0;
  status = ws_cuda_enter(core->device, &previous);
  if (status != WS_OK)
    return status;
  size_t scales_at = 0, amax_at = 0;
  fp8_memory_bytes(core->pieces, plan->groups, &scales_at, &amax_at);
  const ws_cuda_fp8_piece *pieces = core->memory;
  const uint64_t *scales =
      (const uint64_t *)((const char *)core->memory + scales_at);
  uint32_t *amax = (uint32_t *)((char *)core->memory + amax_at);
  const char *call = "cudaMemsetAsync";
  int error = (int)cudaMemsetAsync(amax, 0, plan->groups * sizeof *amax,
                                   (cudaStream_t)raw);
  if (error == cudaSuccess) {
    call = "cudaLaunchKernel";
    error = ws_cuda_launch_fp8(pieces, (uint32_t)core->pieces, scales, amax,
                               (uint32_t)plan->groups, core->warps, raw);
  }
  ws_cuda_leave(previous);
  if (error != cudaSuccess)
    return ws_cuda_failure(error, call,
                           "fp8 plan of %zu ops (%zu pieces, %zu groups) on "
                           "device %d",
                           core->ops, core->pieces, plan->groups,
                           core->device);
  ws_cuda_count_launch();
  return WS_OK;
}

int ws_cuda_fp8_plan_close(ws_cuda_fp8_plan *plan) {
  return close_plan(plan, NULL, "fp8 plan pieces");
}

#else // !WSYNC_WITH_CUDA

static int not_built(void) {
  return ws_fail(WS_ENODEV, "cuda backend: this wsync was built without CUDA");
}

// What a plan's creation answers without CUDA: its arguments' check failure
// (`status`), or that there is no CUDA.
static int create_without_cuda(int status) {
  return status != WS_OK ? status : not_built();
}

// What closing a plan answers without CUDA: no plan can be made, so only
// NULL closes.
static int close_without_cuda(const void *plan) {
  ws_clear_error();
  return plan == NULL ? WS_OK : not_built();
}

// What launching a plan answers without CUDA: there is none to launch.
static int launch_without_cuda(const void *plan, ws_cuda_stream *stream) {
  ws_clear_error();
  (void)plan, (void)stream;
  return not_built();
}

// The copy plan ws_cuda_copy_plan_create_with would build: its arguments are
// checked as with CUDA.
static int create_copy_plan(int device, const ws_cuda_region *regions,
                            size_t region_count, const ws_cuda_copy_op *ops,
                            size_t count, uint64_t tile, uint64_t bulk_min,
                            ws_cuda_copy_plan **out) {
  (void)device, (void)bulk_min, (void)out;
  uint64_t total = 0;
  return create_without_cuda(
      check_copy_plan(regions, region_count, ops, count, tile, &total));
}

int ws_cuda_copy_plan_launch(ws_cuda_copy_plan *plan, ws_cuda_stream *stream) {
  return launch_without_cuda(plan, stream);
}

int ws_cuda_copy_plan_close(ws_cuda_copy_plan *plan) {
  return close_without_cuda(plan);
}

int ws_cuda_synth_plan_create(int device, const ws_cuda_region *regions,
                              size_t region_count, const ws_cuda_synth_op *ops,
                              size_t count, ws_cuda_synth_plan **out) {
  ws_clear_error();
  (void)device, (void)out;
  uint64_t elements = 0, bytes = 0;
  return create_without_cuda(
      check_synth_ops(regions, region_count, ops, count, &elements, &bytes));
}

static int launch_synth(ws_cuda_synth_plan *plan, uint32_t version,
                        ws_cuda_stream *stream, int check) {
  (void)version, (void)check;
  return launch_without_cuda(plan, stream);
}

int ws_cuda_synth_plan_result(ws_cuda_synth_plan *plan,
                              ws_cuda_synth_result *out) {
  ws_clear_error();
  (void)plan, (void)out;
  return not_built();
}

int ws_cuda_synth_plan_close(ws_cuda_synth_plan *plan) {
  return close_without_cuda(plan);
}

int ws_cuda_fp8_plan_create(int device, const ws_cuda_region *regions,
                            size_t region_count, const ws_fp8_group *groups,
                            size_t group_count, const ws_fp8_op *ops,
                            size_t count, ws_cuda_fp8_plan **out) {
  (void)device, (void)out;
  size_t pieces = 0;
  return create_without_cuda(ws_cuda_fp8_layout(
      regions, region_count, groups, group_count, ops, count, NULL, 0, &pieces));
}

int ws_cuda_fp8_plan_launch(ws_cuda_fp8_plan *plan, ws_cuda_stream *stream) {
  return launch_without_cuda(plan, stream);
}

int ws_cuda_fp8_plan_close(ws_cuda_fp8_plan *plan) {
  return close_without_cuda(plan);
}

#endif

// ---------------------------------------------------------------------------
// The public constructors and launches, over what either build provides

int ws_cuda_copy_plan_create(int device, const ws_cuda_region *regions,
                             size_t region_count, const ws_cuda_copy_op *ops,
                             size_t count, ws_cuda_copy_plan **out) {
  return create_copy_plan(device, regions, region_count, ops, count, 0, 0,
                          out);
}

int ws_cuda_copy_plan_create_with(int device, const ws_cuda_region *regions,
                                  size_t region_count,
                                  const ws_cuda_copy_op *ops, size_t count,
                                  const ws_cuda_copy_options *options,
                                  ws_cuda_copy_plan **out) {
  return create_copy_plan(device, regions, region_count, ops, count,
                          options != NULL ? options->tile : 0,
                          options != NULL ? options->bulk : 0, out);
}

int ws_cuda_copy_plan_create_tiled(int device, const ws_cuda_region *regions,
                                   size_t region_count,
                                   const ws_cuda_copy_op *ops, size_t count,
                                   uint64_t tile, ws_cuda_copy_plan **out) {
  if (tile == 0) {
    ws_clear_error();
    return check_tile(tile);
  }
  return create_copy_plan(device, regions, region_count, ops, count, tile, 0,
                          out);
}

int ws_cuda_synth_plan_fill(ws_cuda_synth_plan *plan, uint32_t version,
                            ws_cuda_stream *stream) {
  return launch_synth(plan, version, stream, 0);
}

int ws_cuda_synth_plan_check(ws_cuda_synth_plan *plan, uint32_t version,
                             ws_cuda_stream *stream) {
  return launch_synth(plan, version, stream, 1);
}
