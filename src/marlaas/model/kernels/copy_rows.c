/* Copies cache rows in place: for every move m and every block b (a layer's keys or
 * values), row dst[m] of the block gets the first `run` floats of each of its `heads`
 * head runs from row src[m] (the first columns of every kv head). One pass, no
 * temporary: the caller guarantees no row is both a source and a destination (torch's
 * index_select + index_copy_ reads every moved byte into a temporary first, and is two
 * ops on a strided view).
 *
 * Layout (float32): block b, row r, head h starts at
 * buffer + b * block_stride + r * row_stride + h * head_stride.
 */
#include <stdint.h>
#include <string.h>

void copy_rows_f32(int64_t blocks, int64_t block_stride, int64_t row_stride, int64_t heads,
                   int64_t head_stride, int64_t run, int64_t moves, const int64_t *dst,
                   const int64_t *src, float *buffer) {
    const size_t bytes = (size_t)run * sizeof(float);
    for (int64_t b = 0; b < blocks; ++b) {
        float *block = buffer + b * block_stride;
        for (int64_t m = 0; m < moves; ++m) {
            float *to = block + dst[m] * row_stride;
            const float *from = block + src[m] * row_stride;
            for (int64_t h = 0; h < heads; ++h)
                memcpy(to + h * head_stride, from + h * head_stride, bytes);
        }
    }
}
