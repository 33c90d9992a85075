/* Regression tests for findings of the fuzz harnesses (tests/fuzz,
 * docs/fuzzing.md): each case is the input shape a harness found, checked
 * through the same public function. */
#include <arpa/inet.h>
#include <netinet/in.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdint.h>
#include <sys/socket.h>
#include <unistd.h>

#include "meta/segment_desc.h"
#include "meta/meta.h"
#include "testlib.h"
#include "transport/rdma/rdma_record.h"

/* fuzz_segment_desc: "addr": 1e300 (or -1, or 2^64) was converted with
 * (uint64_t)double: undefined behaviour; now the descriptor is refused. */
static void test_desc_out_of_range_numbers(void) {
  static const char *bad[] = {
      "{\"buffers\":[{\"name\":\"cpu\",\"addr\":1e300,\"length\":4096}]}",
      "{\"buffers\":[{\"name\":\"cpu\",\"addr\":-1,\"length\":4096}]}",
      "{\"buffers\":[{\"name\":\"cpu\",\"addr\":18446744073709551616,\"length\":1}]}",
      "{\"buffers\":[{\"name\":\"cpu\",\"addr\":4096,\"length\":0.5}]}",
      "{\"buffers\":[{\"name\":\"cpu\",\"addr\":18446744073709549568,\"length\":4096}]}",
  };
  for (size_t i = 0; i < sizeof bad / sizeof *bad; i++) {
    mc_remote_desc_t d;
    mc_err_t err = {0};
    CHECK_EQ_INT(mc_segment_desc_decode_regions(bad[i], strlen(bad[i]), &d, &err), MC_EPROTO);
    CHECK_CONTAINS(err.msg, "buffer 1");
    CHECK(d.regions == NULL);
  }
  const char *ok = "{\"pid\":1e300,\"buffers\":[{\"name\":\"cuda:-3\",\"addr\":8192,\"length\":4096,"
                   "\"cuda_ipc\":\"x\",\"cuda_ipc_base\":-5},{\"name\":\"cuda:2\",\"addr\":4096,"
                   "\"length\":4096}]}";
  mc_remote_desc_t d;
  mc_err_t err = {0};
  CHECK_EQ_INT(mc_segment_desc_decode_regions(ok, strlen(ok), &d, &err), 0);
  CHECK_EQ_INT(d.pid, -1);
  CHECK_EQ_INT(d.n, 2);
  CHECK_EQ_INT(d.regions[0].addr, 4096);
  CHECK_EQ_INT(d.regions[0].cuda_dev, 2);
  CHECK_EQ_INT(d.regions[1].cuda_dev, -1); /* "cuda:-3" names no device */
  CHECK_EQ_INT(d.regions[1].ipc[0], '\0'); /* unusable export base */
  mc_remote_desc_free(&d);
}

/* fuzz_rdma_record: a region "addr" of 2^64 passed the old range check
 * (18446744073709551615.0 rounds to 2^64) and was then converted. */
static void test_record_out_of_range_numbers(void) {
  static const char *head =
      "{\"rdma\":\"accept\",\"version\":1,\"from\":\"b\",\"to\":\"a\",\"epoch\":%s,\"nics\":[{\"name\":"
      "\"rxe0\",\"lid\":0,\"gid\":\"fe80:0000:0000:0000:0000:0000:0000:0001\",\"mtu\":1024,"
      "\"roce\":true}],\"qps\":[],\"regions\":[{\"addr\":%s,\"len\":1024,\"rkey\":[%s]}]}";
  static const char *cases[][3] = {
      {"1", "18446744073709551616", "1"},   {"1", "1e300", "1"},
      {"1e300", "4096", "1"},               {"1", "4096", "4294967295.5"},
      {"1", "4096", "4294967296"},          {"-1", "4096", "1"},
      {"1", "18446744073709550592", "1"}, /* addr + len wraps */
  };
  char txt[1024];
  for (size_t i = 0; i < sizeof cases / sizeof *cases; i++) {
    snprintf(txt, sizeof txt, head, cases[i][0], cases[i][1], cases[i][2]);
    mc_rdma_record_t r;
    mc_err_t err = {0};
    CHECK_EQ_INT(mc_rdma_record_decode(txt, strlen(txt), &r, &err), MC_EPROTO);
    CHECK(err.msg[0]);
  }
  snprintf(txt, sizeof txt, head, "9007199254740992", "18446744073709549568", "4294967295");
  mc_rdma_record_t r;
  mc_err_t err = {0};
  CHECK_EQ_INT(mc_rdma_record_decode(txt, strlen(txt), &r, &err), 0);
  CHECK(r.regions[0].addr == 18446744073709549568ull);
  CHECK(r.regions[0].rkey[0] == 4294967295u);
  CHECK(r.epoch == 9007199254740992ull);
  mc_rdma_record_free(&r);
}

/* fuzz_meta: a Redis server that drops the connection while a command is
 * being written raised SIGPIPE in the client (hiredis uses write(2)), which
 * kills any process that does not ignore SIGPIPE.  The server here accepts
 * and closes at once; the 4 MiB PUT's writes then hit a reset connection. */
static int closer_fd;
static atomic_int closer_stop;
static void *closer(void *arg) {
  (void)arg;
  while (!atomic_load(&closer_stop)) {
    int c = accept(closer_fd, NULL, NULL);
    if (c >= 0)
      close(c);
  }
  return NULL;
}

static void test_redis_peer_reset_no_sigpipe(void) {
  signal(SIGPIPE, SIG_DFL); /* as in a C program: SIGPIPE kills */
  struct sockaddr_in a = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
  socklen_t al = sizeof a;
  closer_fd = socket(AF_INET, SOCK_STREAM, 0);
  CHECK(bind(closer_fd, (struct sockaddr *)&a, sizeof a) == 0 && listen(closer_fd, 16) == 0 &&
        getsockname(closer_fd, (struct sockaddr *)&a, &al) == 0);
  pthread_t th;
  pthread_create(&th, NULL, closer, NULL);
  char url[64];
  snprintf(url, sizeof url, "redis://127.0.0.1:%d", ntohs(a.sin_port));
  mc_meta_t *m = NULL;
  mc_err_t err = {0};
  CHECK_EQ_INT(mc_meta_open(url, &m, &err), 0);
  size_t n = 4u << 20;
  char *val = malloc(n);
  memset(val, 'v', n);
  for (int i = 0; i < 3; i++) {
    err = (mc_err_t){0};
    CHECK(mc_meta_put(m, "mooncake/ram/x", val, n, &err) < 0);
    CHECK(err.msg[0]);
  }
  free(val);
  mc_meta_close(m);
  atomic_store(&closer_stop, 1);
  shutdown(closer_fd, SHUT_RDWR);
  int wake = socket(AF_INET, SOCK_STREAM, 0); /* unblocks accept() */
  connect(wake, (struct sockaddr *)&a, sizeof a);
  close(wake);
  pthread_join(th, NULL);
  close(closer_fd);
}

int main(void) {
  RUN(test_desc_out_of_range_numbers);
  RUN(test_record_out_of_range_numbers);
  RUN(test_redis_peer_reset_no_sigpipe);
  TEST_MAIN_END();
}
