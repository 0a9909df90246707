# cuda.mk -- build the CUDA backend (engine/src/cuda/backend_cuda.cu) with nvcc.
#
# Usable two ways:
#   make -C engine -f cuda.mk BUILD=/abs/build/dir /abs/build/dir/backend_cuda.o
#       (what bindings/build_engine.py runs), or
#   include engine/cuda.mk        from a makefile at the repository root.
# Paths below are relative to this file's own directory, so both work.
#
# Targets
#   $(BUILD)/backend_cuda.o   the backend object (link it with $(CUDA_LIBS))
#   $(BUILD)/test_cuda        engine/tests/test_cuda.c: every kernel vs the CPU
#                             backend; prints "N skipped (no GPU: ...)" and
#                             exits 0 where there is no GPU
#   cuda-test                 build and run test_cuda
#
# Only the toolkit is needed to build (nvcc, cudart, cuBLAS); no GPU.

DCS_ENGINE_DIR := $(patsubst %/,%,$(dir $(lastword $(MAKEFILE_LIST))))

NVCC      ?= nvcc
CUDA_HOME ?= /usr/local/cuda
BUILD     ?= build
CC        ?= cc

# Real code for Ampere (sm_80; also runs on sm_86/sm_89) and Hopper (sm_90),
# plus compute_90 PTX that the driver JIT-compiles on newer GPUs (Blackwell).
# nvcc 13 supports compute_75 ... compute_121 (nvcc --list-gpu-arch).
CUDA_ARCHS ?= -gencode arch=compute_80,code=sm_80 \
              -gencode arch=compute_90,code=sm_90 \
              -gencode arch=compute_90,code=compute_90

# --fmad=false: no a*b+c contraction into FMA, so the shared per-element math
# of dcs_math.h rounds the way the CPU build (no -mfma) rounds it.
# -fno-exceptions -fno-threadsafe-statics: the object then needs nothing from
# libstdc++ (nvcc's launch stubs otherwise call __cxa_guard_*), so it links
# into a plain C library or Python extension with just cudart and cuBLAS. The
# only guarded static is the stubs' idempotent kernel-handle lookup.
NVCCFLAGS ?= -O2 -std=c++17 -fmad=false -Xcompiler -fPIC \
             -Xcompiler -fno-exceptions,-fno-threadsafe-statics -Xcompiler -Wall,-Wextra
NVCC_ALL_FLAGS = $(NVCCFLAGS) $(CUDA_ARCHS) -I$(DCS_ENGINE_DIR)/include \
                 -I$(DCS_ENGINE_DIR)/src -DDCS_WITH_CUDA

CUDA_LIBS = -L$(CUDA_HOME)/lib64 -lcudart -lcublas -Wl,-rpath,$(CUDA_HOME)/lib64

CUDA_DEPS = $(DCS_ENGINE_DIR)/src/cuda/backend_cuda.cu $(DCS_ENGINE_DIR)/src/internal.h \
            $(DCS_ENGINE_DIR)/src/dcs_math.h $(DCS_ENGINE_DIR)/include/dcscope.h

$(BUILD)/backend_cuda.o: $(CUDA_DEPS)
	@mkdir -p $(dir $@)
	$(NVCC) $(NVCC_ALL_FLAGS) -c $< -o $@

# The kernel test: the CUDA backend against the CPU backend.
CUDA_TEST_SRCS ?= $(DCS_ENGINE_DIR)/src/error.c $(DCS_ENGINE_DIR)/src/backend_cpu.c $(DCS_ENGINE_DIR)/src/widen.c
CUDA_TEST_CFLAGS ?= -std=c11 -O2 -Wall -Wextra -D_POSIX_C_SOURCE=200809L
BLAS_CFLAGS ?= $(shell pkg-config --cflags openblas 2>/dev/null)
BLAS_LIBS ?= $(shell pkg-config --libs openblas 2>/dev/null || echo -lopenblas)

$(BUILD)/test_cuda: $(DCS_ENGINE_DIR)/tests/test_cuda.c $(CUDA_TEST_SRCS) $(BUILD)/backend_cuda.o
	@mkdir -p $(dir $@)
	$(CC) $(CUDA_TEST_CFLAGS) $(BLAS_CFLAGS) -DDCS_WITH_CUDA -I$(DCS_ENGINE_DIR)/include \
	    -I$(DCS_ENGINE_DIR)/src $(DCS_ENGINE_DIR)/tests/test_cuda.c $(CUDA_TEST_SRCS) \
	    $(BUILD)/backend_cuda.o $(CUDA_LIBS) $(BLAS_LIBS) -lm -o $@

.PHONY: cuda-test
cuda-test: $(BUILD)/test_cuda
	$(BUILD)/test_cuda
