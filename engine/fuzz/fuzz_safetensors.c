/*
 * fuzz_safetensors.c -- libFuzzer target for the safetensors reader.
 * Checks: fuzz_tensors.h. Build and run with engine/fuzz/run.sh.
 */
#include "fuzz_tensors.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    fuzz_parse(dcs_tt_parse_safetensors, "fuzz.safetensors", data, size);
    return 0;
}
