/* Shared bits of the libFuzzer harnesses (docs/fuzzing.md).  Each harness
 * feeds bytes that would come from outside (a peer, a metadata server, a
 * config file) to the parser that reads them, exactly as the library does. */
#ifndef MC_FUZZ_COMMON_H
#define MC_FUZZ_COMMON_H

#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

#include "util/log.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);
int LLVMFuzzerInitialize(int *argc, char ***argv);

/* Harnesses feed malformed input on purpose: the warnings it causes are
 * expected, only sanitizer reports matter.  MC_FUZZ_VERBOSE=1 keeps them. */
static inline void fuzz_quiet(void) {
  const char *v = getenv("MC_FUZZ_VERBOSE");
  if (!v || strcmp(v, "1"))
    mc_log_set_level(MC_LOG_ERROR);
}

/* The whole LLVMFuzzerInitialize of a harness that needs nothing but quiet
 * logs. */
#define FUZZ_INIT_QUIET()                                                                          \
  int LLVMFuzzerInitialize(int *argc, char ***argv) {                                              \
    (void)argc;                                                                                    \
    (void)argv;                                                                                    \
    fuzz_quiet();                                                                                  \
    return 0;                                                                                      \
  }

/* Memory at a fixed address, so that seeds (and the fuzzer) can name it in
 * transfer requests across runs.  Exits (harness setup, not library code)
 * when the address is taken. */
static inline void *fuzz_map_fixed(uintptr_t addr, size_t len) {
  void *p = mmap((void *)addr, len, PROT_READ | PROT_WRITE,
                 MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED_NOREPLACE, -1, 0);
  if (p != (void *)addr) {
    fprintf(stderr, "fuzz harness: cannot map %zu bytes at %#lx\n", len, (unsigned long)addr);
    exit(2);
  }
  return p;
}

/* NUL-terminated copy of the input (parsers that take C strings). */
static inline char *fuzz_strndup(const uint8_t *data, size_t size) {
  char *s = malloc(size + 1);
  if (!s)
    abort();
  memcpy(s, data, size);
  s[size] = '\0';
  return s;
}

#endif
