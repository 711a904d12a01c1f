/* Intel's AMX tiles (AMX-TILE and AMX-BF16, Sapphire Rapids and later), where the
 * compiler targets them (`-march=native` on such a CPU): `HAVE_AMX` is then defined.
 * Linux hands the tiles' state to a process that asks for it (once: the grant is the
 * process's); `amx_allowed` asks and says whether it may use them, so that a kernel
 * falls back to its vector path where the kernel (or a virtual machine's) refuses. */
#ifndef MARLAAS_AMX_H
#define MARLAAS_AMX_H

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#define HAVE_AMX 1
#include <immintrin.h>
#include <stdint.h>
#include <sys/syscall.h>

extern long syscall(long number, ...); /* unistd.h declares it only outside strict C11 */

#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

static inline int amx_allowed(void) {
    static volatile int state = 0; /* 0: not asked, 1: yes, -1: no */
    if (state == 0)
        state = syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0 ? 1 : -1;
    return state > 0;
}

/* `ldtilecfg`'s operand (palette 1): each tile's rows and bytes a row. */
typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} __attribute__((packed, aligned(64))) tile_config;

/* Tiles 0-7 of 64-byte rows, `rows[t]` high. */
static inline void amx_configure(const uint8_t rows[8]) {
    tile_config c = {0};
    c.palette = 1;
    for (int t = 0; t < 8; ++t) {
        c.colsb[t] = 64;
        c.rows[t] = rows[t];
    }
    _tile_loadconfig(&c);
}
#endif

#endif
