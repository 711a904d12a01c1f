/* A pass's tokens in runs of whole units (a unit: a row's tokens, or one token), about
 * `CHUNK_TOKENS` each, that the trainer's native forward (`train_layers.c`) takes one run
 * at a time through the steps that are each token's own (the products, the LoRA updates,
 * the norms, the gated MLP): a run's rows stay in L2 from one step to the next, where the
 * whole pass's went out to L3 and back at each step (a 32-tenant pass: ~2,000 tokens,
 * the MLP's gate and up 5.7 MB; a 2 MB L2 a core). Only the attention, which reads every
 * token's keys, takes the whole pass at once.
 *
 * Each run's units are in lane order, as the per-row LoRA kernels visit them
 * (`lora_rows.c`: a lane's weights prepared once a run), run after run in `order`; a
 * token's values do not depend on the runs (each token's LoRA update is its own).
 */
#ifndef MARLAAS_CHUNKS_H
#define MARLAAS_CHUNKS_H

#include <stdint.h>
#include <stdlib.h>

/* Tokens a run: 128 rows of the embedded base's MLP (gate and up: 360 KB) with its
 * weights fit L2. The trainer's 32 tenants (`bench roofline`'s step, one thread, on an
 * Intel Xeon of 2 MB L2 a core): forward passes 28.0-30.5 -> 23.5-24.4 ms a step (runs
 * of 64 and 256 tokens measured alike, 32 slower). Measured and left whole: the
 * backward (runs of 128 to 512 tokens no faster: each lane's LoRA gradients are read
 * and written again in every run it has tokens in, which costs what the runs save) and
 * the engine's prefill (`decoder_layers.c`: rows of 64 tokens 5% slower, of 192 6%
 * faster, within this machine's noise; its runs of one row make more, smaller products). */
#define CHUNK_TOKENS 128

/* A run: tokens t0 .. t0 + n, its `units` units in lane order at `order`. */
typedef struct {
    int64_t t0, n, units;
    const int64_t *order;
} Chunk;

typedef struct {
    int64_t count, per, units, unit_tokens;
    int64_t *order; /* each run's units in lane order, run after run */
    int owned;      /* order was allocated here (else: the caller's, one run) */
} Chunks;

/* The runs of `units` units of `unit_tokens` tokens each, given the units in lane order
 * (`order`, stable), of `per_run` tokens (at least one unit); one run of the caller's
 * order where memory is short. */
static inline Chunks chunks_of(int64_t units, int64_t unit_tokens, const int64_t *order,
                               int64_t per_run) {
    Chunks c = {0, units, units, unit_tokens, (int64_t *)order, 0};
    if (units == 0) return c;
    c.count = 1;
    const int64_t per = per_run / unit_tokens > 0 ? per_run / unit_tokens : 1;
    if (per >= units) return c;
    int64_t *runs = malloc((size_t)units * sizeof(int64_t));
    const int64_t count = (units + per - 1) / per;
    int64_t *fill = calloc((size_t)count, sizeof(int64_t));
    if (!runs || !fill) {
        free(runs);
        free(fill);
        return c;
    }
    for (int64_t j = 0; j < units; ++j) { /* stable: each run's units stay in lane order */
        const int64_t k = order[j] / per;
        runs[k * per + fill[k]++] = order[j];
    }
    free(fill);
    c.count = count, c.per = per, c.order = runs, c.owned = 1;
    return c;
}

static inline Chunk chunk_at(const Chunks *c, int64_t k) {
    const int64_t u0 = k * c->per, u1 = u0 + c->per < c->units ? u0 + c->per : c->units;
    return (Chunk){u0 * c->unit_tokens, (u1 - u0) * c->unit_tokens, u1 - u0, c->order + u0};
}

static inline void chunks_free(Chunks *c) {
    if (c->owned) free(c->order);
    c->owned = 0;
}

#endif
