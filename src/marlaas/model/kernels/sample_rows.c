/* One token per row of a decode batch's logits, without top-k / top-p: what
 * `marlaas.rollout.sampling.sample_B` computes with torch's ops (about fifteen of them,
 * each a pass over the batch), in a few vector passes over each row.
 *
 * Row b of `logits` [B, V] (row stride ld): with t its temperature (t <= 0: greedy,
 * scaled by 1), the log-probs are log_softmax(logits / t); a greedy row takes the
 * argmax of its raw logits (the first of equal ones, as torch.argmax), a sampling row
 * the first token whose cumulative probability reaches u[b] times the total
 * (`sampling._inverse_cdf`; the probabilities summed in double, as torch's cumsum does
 * on the CPU, sixteen at a time until the block that crosses the target, then one by
 * one). Up to float rounding torch's result: a token differs only where the target
 * lies within rounding of a boundary between two tokens' intervals. tokens[b] and
 * logprobs[b] are written. `all_greedy`: no row samples. `scratch` holds V floats. */
#include <math.h>
#include <stdint.h>

#define BLOCK 16

void sample_rows_f32(int64_t B, int64_t V, const float *logits, int64_t ld,
                     const float *temperature, const float *u, int64_t *tokens,
                     float *logprobs, float *scratch, int64_t all_greedy) {
    for (int64_t b = 0; b < B; ++b) {
        const float *raw = logits + b * ld;
        const int greedy = all_greedy || temperature[b] <= 0.0f;
        const float t = temperature[b] <= 0.0f ? 1.0f : temperature[b];
        float *p = scratch;
        float m = raw[0] / t;  /* (no infinities under -ffast-math: -inf logits are) */
        for (int64_t v = 0; v < V; ++v) {
            p[v] = raw[v] / t;
            m = p[v] > m ? p[v] : m;
        }
        float sum = 0.0f;
        for (int64_t v = 0; v < V; ++v) {
            p[v] = expf(p[v] - m);
            sum += p[v];
        }
        const float log_sum = logf(sum);
        int64_t token = 0;
        if (greedy) {  /* t is 1: the largest scaled logit is the largest raw one */
            while (token + 1 < V && raw[token] != m) ++token;
        } else {
            const float inv = 1.0f / sum;
            double total = 0.0;
            for (int64_t v = 0; v < V; ++v) {
                p[v] *= inv;
                total += (double)p[v];
            }
            const float target = u[b] * (float)total;
            double cum = 0.0;
            int64_t v0 = 0;
            for (; v0 + BLOCK <= V; v0 += BLOCK) {  /* the block that crosses the target */
                double block = 0.0;
                for (int c = 0; c < BLOCK; ++c) block += (double)p[v0 + c];
                if ((float)(cum + block) >= target) break;
                cum += block;
            }
            token = V - 1;
            for (int64_t v = v0; v < V; ++v) {
                cum += (double)p[v];
                if ((float)cum >= target) {
                    token = v;
                    break;
                }
            }
        }
        logprobs[b] = raw[token] / t - m - log_sum;
        tokens[b] = token;
    }
}
