/*
 * fuzz_torchzip.c -- libFuzzer target for the PyTorch zip reader (zip parser and
 * restricted unpickler). The input is a whole checkpoint file.
 * Checks: fuzz_tensors.h. Build and run with engine/fuzz/run.sh.
 */
#include "fuzz_tensors.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    fuzz_parse(dcs_tt_parse_torchzip, "fuzz.bin", data, size);
    return 0;
}
