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
#   make fuzz       -> libFuzzer harnesses (tests/fuzz, clang) in build-fuzz/
#   make fuzz-run FUZZ_SECONDS=N -> each harness N s from its seed corpus;
#                      fails on any finding (docs/fuzzing.md)

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

.PHONY: all lib tests bench test-c fakecuda clean softroce test-rdma bench-rdma ptx fuzz fuzz-run \
        fuzz-run-start
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
	$(CC) $(CFLAGS) -Itests/c $< $(filter %.o,$^) -o $@ $(BUILD)/libmcc.a $(LDLIBS) $(LDFLAGS_SAN)

# Test helpers (tests/c/*.c that are no test_*.c), linked into the tests
# that use them.
$(BUILD)/tests/obj/%.o: tests/c/%.c tests/c/%.h $(shell find csrc -name '*.h')
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS) -Itests/c -c $< -o $@
$(BUILD)/tests/test_engine $(BUILD)/tests/test_gate $(BUILD)/tests/test_gate_notes: \
  $(BUILD)/tests/obj/two_engines.o

$(BUILD)/bench/%: benchmarks/c/%.c $(wildcard benchmarks/c/*.h) $(BUILD)/libmcc.a
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

# A host-memory stand-in for libcuda.so.1 (tests/c/fakecuda.c): the tests of
# CUDA-event paths that run without a GPU load it (test_gate, test_gate_notes; pytest), and
# the same-host GPU path between two processes (test_gpu_ipc_procs; also
# build/bench/gpu_fixed_cost under callgrind: its CUDA IPC handles open).
FAKECUDA := $(BUILD)/fakecuda/libcuda.so.1
fakecuda: $(FAKECUDA)
$(FAKECUDA): tests/c/fakecuda.c
	@mkdir -p $(dir $@)
	$(CC) -std=gnu11 -O2 -Wall -Wextra $(if $(filter 1,$(WERROR)),-Werror,) -fPIC -shared \
	  -pthread -Wl,-soname,libcuda.so.1 $< -o $@

test-c: tests $(FAKECUDA)
	@fail=0; for t in $(TEST_BIN); do \
	  env=; case $$t in */test_gate|*/test_gate_notes|*/test_gpu_ipc_procs) env="LD_LIBRARY_PATH=$(abspath $(dir $(FAKECUDA)))$${LD_LIBRARY_PATH:+:$$LD_LIBRARY_PATH}";; esac; \
	  echo "== $$t"; env $$env ASAN_OPTIONS=detect_leaks=1 $$t || { echo "FAILED: $$t"; fail=1; }; \
	done; exit $$fail

# The same-host copy kernel's PTX is committed; regenerate after editing it.
NVCC ?= $(or $(wildcard /usr/local/cuda/bin/nvcc),nvcc)
ptx:
	python3 scripts/gen_ptx.py $(NVCC) csrc/gpu/copy_kernel.cu csrc/gpu/copy_kernel_ptx.h

# ---- fuzzing (docs/fuzzing.md) ----
# The core is rebuilt with clang under ASan+UBSan and libFuzzer's coverage
# instrumentation; each tests/fuzz/fuzz_*.c is one harness.
comma        := ,
FUZZ_CC      ?= $(or $(shell command -v clang-14 2>/dev/null),clang)
FUZZ_BUILD   := build-fuzz
FUZZ_SECONDS ?= 10
FUZZ_SAN     := -fsanitize=address,undefined -fno-sanitize-recover=undefined
FUZZ_DROP    := -O2 -O1 -fsanitize=address$(comma)undefined -fno-sanitize-recover=undefined
FUZZ_CFLAGS  := $(filter-out $(FUZZ_DROP),$(CFLAGS_BASE)) -Wno-unknown-warning-option -O1 -fno-omit-frame-pointer \
                $(FUZZ_SAN) -fsanitize=fuzzer-no-link
FUZZ_SRC     := $(wildcard tests/fuzz/fuzz_*.c)
FUZZ_BIN     := $(FUZZ_SRC:tests/fuzz/%.c=$(FUZZ_BUILD)/%)
FUZZ_OBJ     := $(CORE_SRC:%.c=$(FUZZ_BUILD)/obj/%.o)

fuzz: $(FUZZ_BIN)

$(FUZZ_BUILD)/obj/%.o: %.c $(shell find csrc -name '*.h')
	@mkdir -p $(dir $@)
	$(FUZZ_CC) $(FUZZ_CFLAGS) -c $< -o $@

$(FUZZ_BUILD)/libmcc.a: $(FUZZ_OBJ)
	rm -f $@ && ar rcs $@ $^

$(FUZZ_BUILD)/fuzz_%: tests/fuzz/fuzz_%.c tests/fuzz/fuzz_common.h $(FUZZ_BUILD)/libmcc.a
	$(FUZZ_CC) $(FUZZ_CFLAGS) -fsanitize=fuzzer -Itests/fuzz $< -o $@ \
	  $(FUZZ_BUILD)/libmcc.a $(LDLIBS)

# Each harness runs FUZZ_SECONDS from its committed seeds (new inputs go to
# build-fuzz/corpus/, findings to build-fuzz/artifacts/); any crash, leak,
# sanitizer report or timeout fails the target.  One target per harness
# (fuzz-run-NAME), so `make -jN fuzz-run` runs N harnesses at a time (CI:
# -j2 on two cores, each harness a core of its own); every harness runs
# even when one fails, and each reports in one piece when it ends.
FUZZ_RUNS    := $(FUZZ_SRC:tests/fuzz/fuzz_%.c=fuzz-run-%)

fuzz-run-start: $(FUZZ_BIN)
	@mkdir -p $(FUZZ_BUILD)/artifacts; rm -f $(FUZZ_BUILD)/*.failed

fuzz-run-%: fuzz-run-start
	@b=$(FUZZ_BUILD)/fuzz_$*; n=$*; mkdir -p $(FUZZ_BUILD)/corpus/$$n; \
	  if $$b -max_total_time=$(FUZZ_SECONDS) -timeout=20 -rss_limit_mb=2048 -print_final_stats=1 \
	    -artifact_prefix=$(FUZZ_BUILD)/artifacts/$$n- $(FUZZ_BUILD)/corpus/$$n \
	    tests/fuzz/corpus/$$n > $(FUZZ_BUILD)/$$n.log 2>&1 \
	    && grep -q 'stat::number_of_executed_units' $(FUZZ_BUILD)/$$n.log; then \
	    printf '== %s (%s s)\n%s\n' $$b $(FUZZ_SECONDS) \
	      "$$(grep -h 'stat::number_of_executed_units' $(FUZZ_BUILD)/$$n.log)"; \
	  else \
	    touch $(FUZZ_BUILD)/$$n.failed; \
	    printf '== %s (%s s)\n%s\nFUZZ FINDING: %s (log %s)\n' $$b $(FUZZ_SECONDS) \
	      "$$(tail -60 $(FUZZ_BUILD)/$$n.log)" $$n $(FUZZ_BUILD)/$$n.log; \
	  fi

fuzz-run: $(FUZZ_RUNS)
	@fail=0; for b in $(FUZZ_BIN); do \
	  [ ! -e $(FUZZ_BUILD)/$${b#$(FUZZ_BUILD)/fuzz_}.failed ] || fail=1; done; exit $$fail

clean:
	rm -rf build build-san build-fuzz
