# kvmill — flat, loud Makefile. Variables first, one rule per artifact.
#   make            library + binaries into bin/
#   make test       build and run every Check suite (tests/check_*.c)
#   make SAN=1 test the same suites under AddressSanitizer + UBSan (CPU only)
#   make bench      benchmarks (bench/run.sh), not part of the tests
#   make fuzz       libFuzzer targets (clang) for every wire decoder and file reader
#   make CUDA=0     CPU-only build even when nvcc is present
#   make deps       install the Debian packages (scripts/install-deps.sh)

SHELL      := /bin/bash
CC         ?= cc
PKGS       := libzmq msgpack lmdb lapacke liblbfgs inih libsodium libpcre2-8 jansson libutf8proc
# OpenBLAS: Debian's serial build when it is installed (scripts/install-deps.sh installs it),
# else whichever `pkg-config openblas` names. kvmill calls BLAS single-threaded from its own
# workers (kernels/cpu/kvm_cpu.c); the pthread build starts server threads from its load-time
# constructor anyway, before main: under an address-space limit (ulimit -v) one spun in malloc
# and the shutdown joined it for ever, or its failed pthread_create raised SIGINT (exit 130, read
# as "interrupted"). The serial build starts none. Its folder goes in as DT_RPATH (not RUNPATH),
# which the loader also uses for liblapacke's own liblapack.so.3, else the pthread build's.
# The serial build is not safe to call from two threads at once (its blas_memory_alloc hands
# out work buffers without a lock): kvmill makes every BLAS call under kvm_blas_lock
# (kernels/kvm_blas.h).
MULTIARCH  := $(shell dpkg-architecture -qDEB_HOST_MULTIARCH 2>/dev/null || $(CC) -print-multiarch 2>/dev/null)
OPENBLAS_SERIAL ?= /usr/lib/$(MULTIARCH)/openblas-serial
ifneq ($(wildcard $(OPENBLAS_SERIAL)/pkgconfig/openblas.pc),)
BLAS_CFLAGS := $(shell PKG_CONFIG_PATH=$(OPENBLAS_SERIAL)/pkgconfig pkg-config --cflags openblas) -DKVM_OPENBLAS_SERIAL=1
BLAS_LIBS  := $(shell PKG_CONFIG_PATH=$(OPENBLAS_SERIAL)/pkgconfig pkg-config --libs openblas) \
              -Wl,--disable-new-dtags,-rpath,$(OPENBLAS_SERIAL)
else
BLAS_CFLAGS := $(shell pkg-config --cflags openblas 2>/dev/null)
BLAS_LIBS  := $(shell pkg-config --libs openblas 2>/dev/null)
endif
KVMILL_SHARED ?= ../shared

# ---- CUDA: on when nvcc is found (PATH or /usr/local/cuda) unless CUDA=0 ----
NVCC       ?= $(shell command -v nvcc 2>/dev/null || { test -x /usr/local/cuda/bin/nvcc && echo /usr/local/cuda/bin/nvcc; })
ifeq ($(NVCC),)
CUDA       ?= 0
else
CUDA       ?= 1
endif

# ---- sanitizer build goes to its own tree so both can coexist ----
ifeq ($(SAN),1)
BUILD      := build-san
BINDIR     := build-san/bin
CUDA       := 0
SANFLAGS   := -fsanitize=address,undefined -fno-omit-frame-pointer -fno-sanitize-recover=undefined
OPT        := -O1 -g
else
BUILD      := build
BINDIR     := bin
SANFLAGS   :=
OPT        := -O2 -g
endif

WARN       := -Wall -Wextra -Werror -Wshadow -Wstrict-prototypes -Wmissing-prototypes -Wno-unused-parameter -Wno-format-truncation
CFLAGS_PKG := $(BLAS_CFLAGS) $(shell pkg-config --cflags $(PKGS) 2>/dev/null)
LIBS_PKG   := $(BLAS_LIBS) $(shell pkg-config --libs $(PKGS) 2>/dev/null)
CPPFLAGS   := -I. -D_POSIX_C_SOURCE=200809L -D_DEFAULT_SOURCE
CFLAGS     := -std=c11 $(OPT) -pthread -ffp-contract=fast -fno-math-errno $(WARN) $(SANFLAGS) $(CFLAGS_PKG)
LDFLAGS    := -pthread $(SANFLAGS)
LDLIBS     := $(LIBS_PKG) -lm

ifeq ($(CUDA),1)
CUDA_HOME  := $(patsubst %/bin/nvcc,%,$(NVCC))
CPPFLAGS   += -DKVM_WITH_CUDA=1
NVFLAGS    := -O2 -I. -std=c++17 --default-stream per-thread --threads 0 -gencode arch=compute_80,code=sm_80 -gencode arch=compute_90,code=sm_90 -Xcompiler -Wall,-Werror
# cuBLAS is opened with dlopen at first use (kernels/cuda/kvm_cuda.cu): linked, its 600 MB would
# load into every process
LDLIBS     += -L$(CUDA_HOME)/lib64 -lcudart -ldl -lstdc++
CU_SRC     := $(wildcard kernels/cuda/*.cu)
else
CU_SRC     :=
endif

# ---- the flags a build tree was built with (build/.flags): a change of them (CUDA=0 after a
# CUDA build, another CC or CFLAGS) rebuilds the tree, whose objects would otherwise link the
# other configuration's library ----
BUILD_FLAGS := $(strip CUDA=$(CUDA) $(CC) $(CPPFLAGS) $(CFLAGS) $(NVFLAGS))
FLAGS_STAMP := $(BUILD)/.flags
# `make` alone builds `all`: the stamp's rule below came first and was the default goal, so a
# fresh clone's `make` built nothing ("build/.flags is up to date")
.DEFAULT_GOAL := all
# a dry run (make -n) writes no stamp: it would mark the tree stale for the next real build
DRY_RUN := $(findstring n,$(firstword -$(MAKEFLAGS)))
ifeq ($(filter clean,$(MAKECMDGOALS))$(DRY_RUN),)
ifneq ($(BUILD_FLAGS),$(strip $(shell cat $(FLAGS_STAMP) 2>/dev/null)))
$(shell mkdir -p $(BUILD) && printf '%s\n' '$(BUILD_FLAGS)' > $(FLAGS_STAMP))
endif
endif
$(FLAGS_STAMP):
	@mkdir -p $(@D)
	printf '%s\n' '$(BUILD_FLAGS)' > $@

# ---- sources ----
LIB_SRC    := $(wildcard common/*.c kernels/*.c kernels/cpu/*.c model/*.c compress/*.c compress/*/*.c \
                         proto/*.c store/*.c pipeline/*.c orchestrator/*.c)
LIB_SRC    := $(filter-out orchestrator/main.c,$(LIB_SRC))
LIB_OBJ    := $(LIB_SRC:%.c=$(BUILD)/%.o) $(CU_SRC:%.cu=$(BUILD)/%.cu.o)
LIB        := $(BUILD)/libkvmill.a
STAGE_SRC  := $(wildcard stages/*.c)
STAGE_BIN  := $(STAGE_SRC:stages/%.c=$(BINDIR)/kvmill-%)
KVMILL     := $(BINDIR)/kvmill
TEST_SRC   := $(wildcard tests/check_*.c)
TEST_BIN   := $(TEST_SRC:tests/%.c=$(BUILD)/tests/%)
TEST_UTIL  := $(wildcard tests/util/*.c)
BENCH_SRC  := $(wildcard bench/*.c)
BENCH_BIN  := $(BENCH_SRC:bench/%.c=$(BUILD)/bench/%)
FUZZ_SRC   := $(wildcard proto/fuzz/fuzz_*.c)
FUZZ_BIN   := $(FUZZ_SRC:proto/fuzz/%.c=build-fuzz/%)
DEPFILES   := $(LIB_OBJ:.o=.d) $(TEST_BIN:=.d) $(BENCH_BIN:=.d)

.PHONY: all test test-multihost bench fuzz fuzz-ci fuzz-replay fuzz-seeds deps clean run lint lint-all model
all: $(KVMILL) $(STAGE_BIN)

# static library of every non-stage, non-main object
$(LIB): $(LIB_OBJ)
	@mkdir -p $(@D)
	rm -f $@ && ar rcs $@ $^

$(BUILD)/%.o: %.c $(FLAGS_STAMP)
	@mkdir -p $(@D)
	$(CC) $(CPPFLAGS) $(CFLAGS) -MMD -MP -c $< -o $@

# the CPU kernels need -O3 for GCC 12 to vectorise their loops; -Wno-psabi: their 512-bit
# vector helpers are static inline, so the AVX-512 argument-passing ABI note does not apply;
# avoid-fma-max-bits=0: -mtune=znver* (e.g. -march=native on an AMD Zen) leaves some 256-bit
# multiply-adds unfused, in one shape of a loop and not in another, which then round apart
# (kernels/LAYOUT.md: the shapes give the same bits); the generic tuning has it at 0 already
KERNEL_FMA   := $(if $(filter gcc% cc,$(notdir $(CC))),--param=avoid-fma-max-bits=0)
KERNEL_FLAGS := $(if $(filter 1,$(SAN)),,-O3) -Wno-psabi $(KERNEL_FMA)
$(BUILD)/kernels/cpu/%.o: kernels/cpu/%.c $(FLAGS_STAMP)
	@mkdir -p $(@D)
	$(CC) $(CPPFLAGS) $(CFLAGS) $(KERNEL_FLAGS) -MMD -MP -c $< -o $@

$(BUILD)/%.cu.o: %.cu $(FLAGS_STAMP)
	@mkdir -p $(@D)
	$(NVCC) $(NVFLAGS) -MMD -MP -MF $(@:.o=.d) -c $< -o $@

# the kvmill CLI
$(KVMILL): orchestrator/main.c $(LIB)
	@mkdir -p $(@D)
	$(CC) $(CPPFLAGS) $(CFLAGS) $< $(LIB) -o $@ $(LDFLAGS) $(LDLIBS)

# one binary per stage process
$(BINDIR)/kvmill-%: stages/%.c $(LIB)
	@mkdir -p $(@D)
	$(CC) $(CPPFLAGS) $(CFLAGS) $< $(LIB) -o $@ $(LDFLAGS) $(LDLIBS)

# LD_PRELOAD shims some suites run kvmill under (tests/preload/*.c say why), next to the suites
# (a suite finds them beside its own binary); never sanitized, never linked into kvmill
PRELOAD_SRC := $(wildcard tests/preload/*.c)
PRELOAD_SO  := $(PRELOAD_SRC:tests/preload/%.c=$(BUILD)/tests/preload/%.so)
.SECONDARY: $(PRELOAD_SO)
$(BUILD)/tests/preload/%.so: tests/preload/%.c
	@mkdir -p $(@D)
	$(CC) -std=c11 -O2 -g -D_GNU_SOURCE -fPIC -shared $(WARN) $(shell pkg-config --cflags libzmq) $< -o $@ -ldl

# one binary per Check suite
$(BUILD)/tests/%: tests/%.c $(TEST_UTIL) $(LIB) | $(PRELOAD_SO)
	@mkdir -p $(@D)
	$(CC) $(CPPFLAGS) -DKVM_TEST_SRCDIR='"$(CURDIR)"' $(CFLAGS) $(shell pkg-config --cflags check) -MMD -MP -MF $@.d $< $(TEST_UTIL) $(LIB) -o $@ \
	    $(LDFLAGS) $(shell pkg-config --libs check) $(LDLIBS)

$(BUILD)/bench/%: bench/%.c $(LIB)
	@mkdir -p $(@D)
	$(CC) $(CPPFLAGS) $(CFLAGS) -O3 -MMD -MP -MF $@.d $< $(LIB) -o $@ $(LDFLAGS) $(LDLIBS)

# make test: every suite runs even if one fails (tests/run-suites.sh: twice as many at a time as
# there are cores, at most 8, the slowest first, each one's output shown whole when it ends;
# KVMILL_TEST_JOBS=1 runs them one after the other); the last line sums them up and names any
# suite that crashed before reporting. TESTS="check_cli check_store" runs only
# those suites (.ci/run's fresh-clone pass runs the suites that read KVMILL_SHARED). Under SAN=1
# the suites see KVMILL_TEST_QUICK=1 (tests/util/kvm_test.h: the slowest integration cases on
# fewer inputs; KVMILL_TEST_QUICK=0 in the environment runs them whole there too).
TESTS      ?=
RUN_TESTS  := $(if $(strip $(TESTS)),$(addprefix $(BUILD)/tests/,$(basename $(notdir $(TESTS)))),$(TEST_BIN))
TEST_QUICK := $(if $(filter 1,$(SAN)),1,)
test: all $(RUN_TESTS)
	@fail=0; if [ -n "$(FUZZ_SRC)" ] && [ -z "$(strip $(TESTS))" ]; then \
	    $(MAKE) --no-print-directory fuzz-replay || fail=1; fi; \
	KVMILL_BIN=$(abspath $(BINDIR)) KVMILL_SHARED=$(KVMILL_SHARED) CK_DEFAULT_TIMEOUT=$${CK_DEFAULT_TIMEOUT:-120} \
	KVMILL_TEST_QUICK=$${KVMILL_TEST_QUICK-$(TEST_QUICK)} \
	    bash tests/run-suites.sh $(BUILD)/test-logs $(addprefix ./,$(RUN_TESTS)) || fail=1; \
	exit $$fail

bench: all $(BENCH_BIN)
	KVMILL_BIN=$(abspath $(BINDIR)) KVMILL_BUILD=$(abspath $(BUILD)) KVMILL_SHARED=$(KVMILL_SHARED) bash bench/run.sh

# make test-multihost: several hosts in network namespaces over TCP, and a single-node Slurm
# cluster (root; each part prints one SKIP: line where it cannot run here)
test-multihost: all
	@fail=0; for t in tests/multihost/*.sh; do echo "== $$t"; \
	    KVMILL_BIN=$(abspath $(BINDIR)) timeout 600 bash $$t || fail=1; done; exit $$fail

# ---- fuzzers (clang, libFuzzer + ASan): proto/fuzz/fuzz_<type>.c, one per wire decoder, and
# fuzz/fuzz_file_<format>.c, one per reader of a file a user hands kvmill (GGUF, safetensors,
# config.json, tokenizer.json, llama2.c checkpoint and tokenizer, .kvs, strategy and signals
# files). Each target's seeds are in corpus/<target>/ beside its source ----
comma      := ,
FUZZ_CC    := clang
# -fno-sanitize-recover: undefined behaviour stops the run like an ASan report (UBSan's default
# prints one line and goes on, so fuzz-ci passed over it)
FUZZ_FLAGS := -std=c11 -g -O1 -fsanitize=fuzzer,address,undefined -fno-sanitize-recover=undefined -I. \
              -D_POSIX_C_SOURCE=200809L -D_DEFAULT_SOURCE $(CFLAGS_PKG)
# build-fuzz/.flags: a change of FUZZ_FLAGS (or CC for the kernels) rebuilds every fuzz object
FUZZ_STAMP := build-fuzz/.flags
ifeq ($(filter clean,$(MAKECMDGOALS)),)
ifneq ($(strip $(FUZZ_FLAGS) $(CC) $(CFLAGS)),$(strip $(shell cat $(FUZZ_STAMP) 2>/dev/null)))
$(shell mkdir -p build-fuzz && printf '%s\n' '$(strip $(FUZZ_FLAGS) $(CC) $(CFLAGS))' > $(FUZZ_STAMP))
endif
endif
$(FUZZ_STAMP):
	@mkdir -p $(@D)
	printf '%s\n' '$(strip $(FUZZ_FLAGS) $(CC) $(CFLAGS))' > $@
FUZZ_LIBSRC:= common/kvm_error.c $(wildcard proto/*.c)
# the file readers' archive holds model/, compress/ and the CPU kernels (no CUDA: KVM_WITH_CUDA
# unset); the readers do not run the kernels, which clang 14 cannot compile (no _Float16 on x86):
# $(CC) builds them uninstrumented, as for the library
FFUZZ_SRC  := $(wildcard fuzz/fuzz_file_*.c)
FFUZZ_LIBSRC := $(wildcard common/*.c kernels/*.c kernels/cpu/*.c model/*.c compress/*/*.c proto/*.c)
# the decoders are compiled once (instrumented, no fuzzer main) into one archive per family that
# every target of it links, rather than once per target
FUZZ_LIBOBJ:= $(FUZZ_LIBSRC:%.c=build-fuzz/obj/%.o)
FFUZZ_LIBOBJ := $(FFUZZ_LIBSRC:%.c=build-fuzz/obj/%.o)
FUZZ_LIB   := build-fuzz/libkvmill-proto.a
FFUZZ_LIB  := build-fuzz/libkvmill-files.a
FUZZ_SRC   += $(FFUZZ_SRC)
FUZZ_BIN   += $(FFUZZ_SRC:fuzz/%.c=build-fuzz/%)
build-fuzz/obj/%.o: %.c $(FUZZ_STAMP)
	@mkdir -p $(@D)
	$(FUZZ_CC) $(subst fuzzer$(comma),fuzzer-no-link$(comma),$(FUZZ_FLAGS)) -MMD -MP -c $< -o $@
build-fuzz/obj/kernels/cpu/%.o: kernels/cpu/%.c $(FUZZ_STAMP)
	@mkdir -p $(@D)
	$(CC) $(filter-out -DKVM_WITH_CUDA=1,$(CPPFLAGS)) $(CFLAGS) -O3 -Wno-psabi $(KERNEL_FMA) -MMD -MP -c $< -o $@
$(FUZZ_LIB): $(FUZZ_LIBOBJ)
	rm -f $@ && ar rcs $@ $^
$(FFUZZ_LIB): $(FFUZZ_LIBOBJ)
	rm -f $@ && ar rcs $@ $^
build-fuzz/%: proto/fuzz/%.c proto/fuzz/fuzz_common.h $(wildcard proto/*.h) $(FUZZ_LIB) $(FUZZ_STAMP)
	@mkdir -p $(@D)
	$(FUZZ_CC) $(FUZZ_FLAGS) $< $(FUZZ_LIB) -o $@ $(LIBS_PKG) -lm
build-fuzz/%: fuzz/%.c fuzz/fuzz_file.h $(FFUZZ_LIB) $(FUZZ_STAMP)
	@mkdir -p $(@D)
	$(FUZZ_CC) $(FUZZ_FLAGS) -MMD -MP -MF $@.d $< $(FFUZZ_LIB) -o $@ -pthread $(LIBS_PKG) -lm
# a target's seed folder: corpus/<name>/ beside its source
fuzz_seeds  = $(dir $(filter %/$(notdir $(1)).c,$(FUZZ_SRC)))corpus/$(notdir $(1))
FUZZ_PAIRS := $(foreach b,$(FUZZ_BIN),$(b):$(call fuzz_seeds,$(b)))
FUZZ_RUNS  ?= 20000
fuzz: $(FUZZ_BIN)
	@for p in $(FUZZ_PAIRS); do f=$${p%%:*}; s=$${p#*:}; n=$$(basename $$f); mkdir -p build-fuzz/corpus/$$n; \
	    echo "== $$n"; $$f -runs=$(FUZZ_RUNS) build-fuzz/corpus/$$n $$s || exit 1; done
# CI's short pass: FUZZ_SECONDS split evenly over the targets, FUZZ_JOBS of them at a time (each
# on its own corpus folder and log; a failure's log tail is shown once all have ended)
FUZZ_SECONDS ?= 60
FUZZ_JOBS  ?= $(shell nproc 2>/dev/null || echo 1)
fuzz-ci: $(FUZZ_BIN)
	@n=$$(echo $(FUZZ_BIN) | wc -w); per=$$(( $(FUZZ_SECONDS) / (n > 0 ? n : 1) )); [ $$per -ge 1 ] || per=1; \
	for f in $(FUZZ_BIN); do mkdir -p build-fuzz/corpus/$$(basename $$f); rm -f $$f.failed; done; \
	printf '%s\n' $(FUZZ_PAIRS) | xargs -r -P $(FUZZ_JOBS) -n 1 sh -c 'f=$${2%%:*}; s=$${2#*:}; b=$$(basename "$$f"); \
	    echo "== fuzz $$b for $$1s"; "$$f" -max_total_time=$$1 build-fuzz/corpus/$$b "$$s" >build-fuzz/$$b.log 2>&1 || touch "$$f.failed"' \
	    fuzz $$per; \
	fail=0; for f in $(FUZZ_BIN); do [ ! -e $$f.failed ] || { echo "== fuzz $$(basename $$f) failed:"; \
	    tail -50 build-fuzz/$$(basename $$f).log; rm -f $$f.failed; fail=1; }; done; exit $$fail
# replays the saved corpus (seeds + every input that ever crashed a decoder)
fuzz-replay: $(FUZZ_BIN)
	@for p in $(FUZZ_PAIRS); do f=$${p%%:*}; s=$${p#*:}; n=$$(basename $$f); \
	    echo "== replay $$n"; $$f -runs=0 $$s >/dev/null 2>build-fuzz/$$n.replay.log \
	      || { cat build-fuzz/$$n.replay.log; exit 1; }; done
# rewrites the file fuzzers' seeds (fuzz/corpus/) from the writers in the library (fuzz/gen_corpus.c)
fuzz-seeds: $(LIB)
	@mkdir -p $(BUILD)/fuzz
	$(CC) $(CPPFLAGS) $(CFLAGS) fuzz/gen_corpus.c $(LIB) -o $(BUILD)/fuzz/gen_corpus $(LDFLAGS) $(LDLIBS)
	$(BUILD)/fuzz/gen_corpus fuzz/corpus

-include $(wildcard build-fuzz/obj/*/*.d build-fuzz/obj/*/*/*.d build-fuzz/*.d)

deps:
	bash scripts/install-deps.sh

model:
	bash scripts/get-model.sh

# the README's first command: install what is missing, build, run the main job on
# $(KVMILL_SHARED)/data/long when that folder exists, else on the embedded data/corpus
RUN_CORPUS ?= $(if $(wildcard $(KVMILL_SHARED)/data/long/*.txt),$(KVMILL_SHARED)/data/long,data/corpus)
run:
	bash scripts/install-deps.sh
	$(MAKE) --no-print-directory all
	@echo "kvmill run: corpus $(RUN_CORPUS), model data/models/stories260K.bin (configs/default.ini)"
	KVMILL_SHARED=$(KVMILL_SHARED) $(KVMILL) run --config configs/default.ini --corpus $(RUN_CORPUS)

# make lint: clang-format (.clang-format) on the lines changed since LINT_BASE (default HEAD: the
# uncommitted changes; LINT_BASE=main checks a branch's commits too). Whole files are not checked:
# the tree keeps hand-aligned struct comments and one-line loops that clang-format 14 would undo
# (a trial reformat changed 210 files). make lint-all lists every file that differs.
LINT_BASE ?= HEAD
lint:
	@command -v git-clang-format >/dev/null || { echo "lint: needs git-clang-format (Debian package clang-format)"; exit 2; }
	@out=$$(git clang-format --diff --extensions c,h,cu,cuh $(LINT_BASE)) || exit 2; \
	case "$$out" in "no modified files to format"|"clang-format did not modify any files"|"") echo "lint: clean since $(LINT_BASE)";; \
	*) printf '%s\n' "$$out"; echo "lint: the lines above differ from .clang-format (git clang-format $(LINT_BASE) applies it)"; exit 1;; esac
lint-all:
	@clang-format --dry-run $(LIB_SRC) orchestrator/main.c $(STAGE_SRC) $(TEST_SRC) 2>&1 | grep -o '^[^:]*\.[ch]' | sort -u

clean:
	rm -rf build build-san build-fuzz bin

-include $(DEPFILES)
