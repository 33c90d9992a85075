# One build description for the C side: the static core library, the C unit
# tests and the C benchmark binaries.  The Python extension is built by
# setup.py from the same sources (csrc/**/*.c).
#
#   make            -> build/libmcc.a, tests, benchmark tools
#   make test-c     -> run every C test
#   make SAN=1 test-c   -> same under ASan+UBSan (separate build dir)
#   make WERROR=1   -> warnings are errors (CI)
#   make test-rdma  -> the RDMA transport's tests inside the SoftRoCE guest
#   make bench-rdma -> our RDMA WRITE bandwidth vs ib_write_bw in the guest

CC      ?= cc
SAN     ?= 0
WERROR  ?= 0
BUILD   ?= build$(if $(filter 1,$(SAN)),-san,)

CFLAGS_BASE := -std=gnu11 -O2 -g -Wall -Wextra -Wno-format-truncation -fPIC -pthread -Icsrc \
               -fvisibility=hidden -D_GNU_SOURCE
ifeq ($(WERROR),1)
CFLAGS_BASE += -Werror
endif
ifeq ($(SAN),1)
CFLAGS_BASE += -O1 -fsanitize=address,undefined -fno-omit-frame-pointer \
               -fno-sanitize-recover=undefined
LDFLAGS_SAN := -fsanitize=address,undefined
endif
CFLAGS  := $(CFLAGS_BASE) $(EXTRA_CFLAGS)
LDLIBS  := -lcjson -lcurl -lhiredis -lxxhash -ldl -lpthread -lm

CORE_SRC  := $(shell find csrc -name '*.c' -not -path 'csrc/py/*' | sort)
CORE_OBJ  := $(CORE_SRC:%.c=$(BUILD)/obj/%.o)
TEST_SRC  := $(wildcard tests/c/test_*.c)
TEST_BIN  := $(TEST_SRC:tests/c/%.c=$(BUILD)/tests/%)
BENCH_SRC := $(wildcard benchmarks/c/*.c)
BENCH_BIN := $(BENCH_SRC:benchmarks/c/%.c=$(BUILD)/bench/%)

.PHONY: all lib tests bench test-c clean softroce test-rdma bench-rdma ptx
all: lib tests bench softroce
lib: $(BUILD)/libmcc.a
tests: $(TEST_BIN)
bench: $(BENCH_BIN)

$(BUILD)/obj/%.o: %.c $(shell find csrc -name '*.h')
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS) -c $< -o $@

$(BUILD)/libmcc.a: $(CORE_OBJ)
	@mkdir -p $(dir $@)
	rm -f $@ && ar rcs $@ $^

$(BUILD)/tests/%: tests/c/%.c tests/c/testlib.h $(BUILD)/libmcc.a
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS) -Itests/c $< -o $@ $(BUILD)/libmcc.a $(LDLIBS) $(LDFLAGS_SAN)

$(BUILD)/bench/%: benchmarks/c/%.c $(BUILD)/libmcc.a
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS) $< -o $@ $(BUILD)/libmcc.a $(LDLIBS) $(LDFLAGS_SAN)

# Programs for the SoftRoCE guest (tests/softroce), linked against the core.
SOFTROCE_BIN := $(BUILD)/softroce/rdma_transfer_test
softroce: $(SOFTROCE_BIN)
$(BUILD)/softroce/%: tests/softroce/%.c $(BUILD)/libmcc.a
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS) $< -o $@ $(BUILD)/libmcc.a $(LDLIBS) $(LDFLAGS_SAN)

test-rdma: $(SOFTROCE_BIN)
	TIMEOUT=300 tests/softroce/run-in-guest.sh $(SOFTROCE_BIN) all
bench-rdma: $(SOFTROCE_BIN)
	TIMEOUT=600 MC_GUEST_PERFTEST=1 tests/softroce/run-in-guest.sh $(SOFTROCE_BIN) bench

test-c: tests
	@fail=0; for t in $(TEST_BIN); do \
	  echo "== $$t"; ASAN_OPTIONS=detect_leaks=1 $$t || { echo "FAILED: $$t"; fail=1; }; \
	done; exit $$fail

# The same-host copy kernel's PTX is committed; regenerate after editing it.
NVCC ?= $(or $(wildcard /usr/local/cuda/bin/nvcc),nvcc)
ptx:
	python3 scripts/gen_ptx.py $(NVCC) csrc/gpu/copy_kernel.cu csrc/gpu/copy_kernel_ptx.h

clean:
	rm -rf build build-san
