/* The engine's slicing knobs: MC_SLICE_SIZE / MC_OP_ENTRIES (they apply to
 * every transport), their former names MC_TCP_SLICE_SIZE / MC_TCP_OP_ENTRIES
 * still accepted with one INFO line naming the new one, and both names set
 * to different values refused, naming both. */
#include <stdlib.h>
#include <unistd.h>

#include "engine/engine_internal.h"
#include "testlib.h"
#include "util/log.h"

static const char *const names[] = {"MC_SLICE_SIZE", "MC_OP_ENTRIES", "MC_TCP_SLICE_SIZE",
                                    "MC_TCP_OP_ENTRIES"};

static void clear_env(void) {
  for (size_t i = 0; i < sizeof names / sizeof names[0]; i++)
    unsetenv(names[i]);
}

/* Creates an engine with the environment as it is; its stderr (the log) goes
 * to log[] (NUL-terminated). */
static int create(mc_engine_t **e, mc_err_t *err, char *log, size_t cap) {
  mc_engine_opts_t o = {.local_hostname = "127.0.0.1", .metadata_server = "P2PHANDSHAKE",
                        .protocol = "tcp"};
  fflush(stderr);
  FILE *tmp = tmpfile();
  int saved = dup(2);
  dup2(fileno(tmp), 2);
  int rc = mc_engine_create(&o, e, err);
  fflush(stderr);
  dup2(saved, 2);
  close(saved);
  rewind(tmp);
  size_t n = fread(log, 1, cap - 1, tmp);
  log[n] = 0;
  fclose(tmp);
  return rc;
}

static void test_defaults(void) {
  clear_env();
  mc_engine_t *e = NULL;
  mc_err_t err = {0};
  char log[4096];
  CHECK_EQ_INT(create(&e, &err, log, sizeof log), 0);
  CHECK_EQ_INT(e->slice_size, 4 << 20);
  CHECK_EQ_INT(e->op_entries, 256);
  mc_engine_destroy(e);
}

static void test_new_names(void) {
  clear_env();
  setenv("MC_SLICE_SIZE", "65536", 1);
  setenv("MC_OP_ENTRIES", "3", 1);
  mc_engine_t *e = NULL;
  mc_err_t err = {0};
  char log[4096];
  CHECK_EQ_INT(create(&e, &err, log, sizeof log), 0);
  CHECK_EQ_INT(e->slice_size, 65536);
  CHECK_EQ_INT(e->op_entries, 3);
  CHECK(!strstr(log, "former name"));
  mc_engine_destroy(e);
}

static void test_former_names_accepted(void) {
  clear_env();
  setenv("MC_TCP_SLICE_SIZE", "131072", 1);
  setenv("MC_TCP_OP_ENTRIES", "5", 1);
  mc_engine_t *e = NULL;
  mc_err_t err = {0};
  char log[4096];
  CHECK_EQ_INT(create(&e, &err, log, sizeof log), 0);
  CHECK_EQ_INT(e->slice_size, 131072);
  CHECK_EQ_INT(e->op_entries, 5);
  CHECK_CONTAINS(log, "MC_TCP_SLICE_SIZE is the former name of MC_SLICE_SIZE");
  CHECK_CONTAINS(log, "MC_TCP_OP_ENTRIES is the former name of MC_OP_ENTRIES");
  mc_engine_destroy(e);
}

static void test_both_names_same_value(void) {
  clear_env();
  setenv("MC_SLICE_SIZE", "65536", 1);
  setenv("MC_TCP_SLICE_SIZE", "65536", 1);
  mc_engine_t *e = NULL;
  mc_err_t err = {0};
  char log[4096];
  CHECK_EQ_INT(create(&e, &err, log, sizeof log), 0);
  CHECK_EQ_INT(e->slice_size, 65536);
  mc_engine_destroy(e);
}

static void test_both_names_differ_refused(void) {
  clear_env();
  setenv("MC_OP_ENTRIES", "3", 1);
  setenv("MC_TCP_OP_ENTRIES", "7", 1);
  mc_engine_t *e = NULL;
  mc_err_t err = {0};
  char log[4096];
  CHECK_EQ_INT(create(&e, &err, log, sizeof log), MC_ECONFIG);
  CHECK(e == NULL);
  CHECK_CONTAINS(err.msg, "MC_OP_ENTRIES=\"3\" and MC_TCP_OP_ENTRIES=\"7\" are both set");
  CHECK_CONTAINS(err.msg, "unset MC_TCP_OP_ENTRIES");
}

int main(void) {
  mc_log_set_level(MC_LOG_INFO);
  RUN(test_defaults);
  RUN(test_new_names);
  RUN(test_former_names_accepted);
  RUN(test_both_names_same_value);
  RUN(test_both_names_differ_refused);
  clear_env();
  TEST_MAIN_END();
}
