/* The AMX tile configuration of the CPU kernels that use tiles (included inside their AMX
 * sections, not compiled alone). */
#ifndef KUBEINFER_AMX_TILES_H
#define KUBEINFER_AMX_TILES_H

#include <stdint.h>

struct tile_config {
    uint8_t palette;
    uint8_t start_row;
    uint8_t reserved[14];
    uint16_t bytes_per_row[16];
    uint8_t rows[16];
};

/* Eight tiles of 16 rows x 64 bytes. A constant, not filled on the stack before LDTILECFG:
 * GCC 12 drops such stores (what breaks llama.cpp's AMX build here, see BENCHMARKS.md). */
static const struct tile_config TILES_16x64 __attribute__((aligned(64))) = {
    .palette = 1,
    .bytes_per_row = {64, 64, 64, 64, 64, 64, 64, 64},
    .rows = {16, 16, 16, 16, 16, 16, 16, 16},
};

#endif
