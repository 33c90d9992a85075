/*
 * tcp_pingpong -- raw TCP reference numbers for the transfer-engine benchmarks.
 *
 * Plain blocking sockets, no project code: this is the "what does the kernel
 * give us" baseline that our engine is compared against.
 *
 *   tcp_pingpong server [--bind ADDR] [--port P] [--once]
 *       Serves ping-pong and stream clients (one connection at a time).
 *       --port 0 picks a free port.  The first stdout line is always
 *       {"listening":PORT}.  --once exits after the first client.
 *
 *   tcp_pingpong client --host H --port P [--size 4096] [--iters 10000]
 *                       [--warmup N] [--spin]
 *       Ping-pong of SIZE-byte messages (TCP_NODELAY on both ends); prints
 *       {"mode":"pingpong","size":..,"iters":..,"p50_us":..,"p99_us":..,
 *        "mean_us":..,"min_us":..,"max_us":..,"spin":0|1}
 *       --spin: both ends busy-poll (non-blocking recv in a loop) instead of
 *       sleeping in recv().  On VMs, waking a halted vCPU can cost tens of
 *       microseconds; a polling engine never pays that, so compare it with
 *       the --spin numbers.
 *
 *   tcp_pingpong stream-server ...   same as "server"
 *   tcp_pingpong stream --host H --port P [--bytes 1073741824]
 *                       [--write-size 65536]
 *       One-way bulk send of BYTES in WRITE-SIZE writes; the server answers
 *       with an 8-byte ack after the last byte.  Time is from the first
 *       write to the ack.  Prints {"mode":"stream",...,"gbps":..} where
 *       gbps is 1e9 bytes per second.
 *
 * Wire: 32-byte little-endian hello {u32 magic 'TPP1', u32 mode, u64 size,
 * u64 count, u64 flags}.  mode 1 = ping-pong (size = message size, count =
 * number of round trips), mode 2 = stream (size = total bytes, count = the
 * client's write size, informational).  flags bit 0 = busy-poll.
 */
#include <arpa/inet.h>
#include <errno.h>
#include <limits.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/types.h>
#include <time.h>
#include <unistd.h>

#define HELLO_MAGIC 0x31505054u /* "TPP1" little-endian */
#define HELLO_LEN 32
#define MODE_PINGPONG 1u
#define MODE_STREAM 2u
#define MAX_MSG (1ull << 30)
#define FLAG_SPIN 1u

static void die(const char *what)
{
    fprintf(stderr, "tcp_pingpong: %s: %s\n", what, strerror(errno));
    exit(1);
}

static void usage(void)
{
    fputs("usage:\n"
          "  tcp_pingpong server|stream-server [--bind ADDR] [--port P] [--once]\n"
          "  tcp_pingpong client --host H --port P [--size B] [--iters N] [--warmup N]"
          " [--spin]\n"
          "  tcp_pingpong stream|stream-client --host H --port P [--bytes N]"
          " [--write-size B]\n",
          stderr);
    exit(2);
}

static double now_us(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec * 1e6 + (double)ts.tv_nsec / 1e3;
}

static void put_u32(unsigned char *p, uint32_t v)
{
    for (int i = 0; i < 4; i++)
        p[i] = (unsigned char)(v >> (8 * i));
}

static void put_u64(unsigned char *p, uint64_t v)
{
    for (int i = 0; i < 8; i++)
        p[i] = (unsigned char)(v >> (8 * i));
}

static uint32_t get_u32(const unsigned char *p)
{
    uint32_t v = 0;
    for (int i = 3; i >= 0; i--)
        v = (v << 8) | p[i];
    return v;
}

static uint64_t get_u64(const unsigned char *p)
{
    uint64_t v = 0;
    for (int i = 7; i >= 0; i--)
        v = (v << 8) | p[i];
    return v;
}

/* 0 on success, -1 on error or EOF (errno = 0 for EOF).  spin: poll with
 * MSG_DONTWAIT instead of sleeping in the kernel. */
static int read_full_mode(int fd, void *buf, size_t len, int spin)
{
    unsigned char *p = buf;
    int flags = spin ? MSG_DONTWAIT : 0;
    while (len > 0) {
        ssize_t n = recv(fd, p, len, flags);
        if (n > 0) {
            p += n;
            len -= (size_t)n;
        } else if (n == 0) {
            errno = 0;
            return -1;
        } else if (errno != EINTR && !(spin && (errno == EAGAIN || errno == EWOULDBLOCK))) {
            return -1;
        }
    }
    return 0;
}

static int read_full(int fd, void *buf, size_t len)
{
    return read_full_mode(fd, buf, len, 0);
}

static int write_full(int fd, const void *buf, size_t len)
{
    const unsigned char *p = buf;
    while (len > 0) {
        ssize_t n = send(fd, p, len, MSG_NOSIGNAL);
        if (n > 0) {
            p += n;
            len -= (size_t)n;
        } else if (n < 0 && errno != EINTR) {
            return -1;
        }
    }
    return 0;
}

static void set_nodelay(int fd)
{
    int one = 1;
    if (setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one) != 0)
        die("setsockopt(TCP_NODELAY)");
}

static unsigned long long parse_u64(const char *s, const char *opt)
{
    char *end = NULL;
    errno = 0;
    unsigned long long v = strtoull(s, &end, 0);
    if (errno != 0 || end == s || *end != '\0' || s[0] == '-') {
        fprintf(stderr, "tcp_pingpong: bad value for %s: '%s'\n", opt, s);
        exit(2);
    }
    return v;
}

static int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

/* Nearest-rank percentile over a sorted array. */
static double percentile(const double *sorted, size_t n, double pct)
{
    if (n == 0)
        return 0.0;
    double rank = pct / 100.0 * (double)n;
    size_t idx = (size_t)rank;
    if ((double)idx < rank)
        idx++;
    if (idx == 0)
        idx = 1;
    if (idx > n)
        idx = n;
    return sorted[idx - 1];
}

/* ---------------------------------------------------------------- server */

static void serve_pingpong(int fd, uint64_t size, uint64_t count, int spin)
{
    unsigned char *buf = malloc(size ? size : 1);
    if (!buf)
        die("malloc");
    for (uint64_t i = 0; i < count; i++) {
        if (read_full_mode(fd, buf, size, spin) != 0 || write_full(fd, buf, size) != 0)
            break;
    }
    free(buf);
}

static void serve_stream(int fd, uint64_t total)
{
    size_t bufsz = 1u << 20;
    unsigned char *buf = malloc(bufsz);
    if (!buf)
        die("malloc");
    uint64_t got = 0;
    while (got < total) {
        size_t want = (total - got) < bufsz ? (size_t)(total - got) : bufsz;
        ssize_t n = recv(fd, buf, want, 0);
        if (n > 0)
            got += (uint64_t)n;
        else if (n == 0 || errno != EINTR)
            break;
    }
    unsigned char ack[8];
    put_u64(ack, got);
    (void)write_full(fd, ack, sizeof ack);
    free(buf);
}

static void serve_one(int fd)
{
    unsigned char hello[HELLO_LEN];
    set_nodelay(fd);
    if (read_full(fd, hello, sizeof hello) != 0)
        return;
    if (get_u32(hello) != HELLO_MAGIC) {
        fprintf(stderr, "tcp_pingpong: bad hello from client\n");
        return;
    }
    uint32_t mode = get_u32(hello + 4);
    uint64_t size = get_u64(hello + 8);
    uint64_t count = get_u64(hello + 16);
    int spin = (get_u64(hello + 24) & FLAG_SPIN) != 0;
    if (mode == MODE_PINGPONG && size <= MAX_MSG)
        serve_pingpong(fd, size, count, spin);
    else if (mode == MODE_STREAM)
        serve_stream(fd, size);
    else
        fprintf(stderr, "tcp_pingpong: bad mode %u size %llu\n", mode,
                (unsigned long long)size);
}

static int run_server(const char *bind_addr, unsigned port, int once)
{
    int lfd = socket(AF_INET, SOCK_STREAM, 0);
    if (lfd < 0)
        die("socket");
    int one = 1;
    if (setsockopt(lfd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one) != 0)
        die("setsockopt(SO_REUSEADDR)");
    struct sockaddr_in sa;
    memset(&sa, 0, sizeof sa);
    sa.sin_family = AF_INET;
    sa.sin_port = htons((uint16_t)port);
    if (inet_pton(AF_INET, bind_addr, &sa.sin_addr) != 1) {
        fprintf(stderr, "tcp_pingpong: bad --bind address '%s'\n", bind_addr);
        return 2;
    }
    if (bind(lfd, (struct sockaddr *)&sa, sizeof sa) != 0)
        die("bind");
    if (listen(lfd, 16) != 0)
        die("listen");
    socklen_t slen = sizeof sa;
    if (getsockname(lfd, (struct sockaddr *)&sa, &slen) != 0)
        die("getsockname");
    printf("{\"listening\":%u}\n", (unsigned)ntohs(sa.sin_port));
    fflush(stdout);
    for (;;) {
        int fd = accept(lfd, NULL, NULL);
        if (fd < 0) {
            if (errno == EINTR || errno == ECONNABORTED)
                continue;
            die("accept");
        }
        serve_one(fd);
        close(fd);
        if (once)
            break;
    }
    close(lfd);
    return 0;
}

/* ---------------------------------------------------------------- client */

static int connect_to(const char *host, unsigned port)
{
    char portstr[16];
    snprintf(portstr, sizeof portstr, "%u", port);
    struct addrinfo hints, *res = NULL;
    memset(&hints, 0, sizeof hints);
    hints.ai_family = AF_UNSPEC;
    hints.ai_socktype = SOCK_STREAM;
    int rc = getaddrinfo(host, portstr, &hints, &res);
    if (rc != 0) {
        fprintf(stderr, "tcp_pingpong: resolve %s: %s\n", host, gai_strerror(rc));
        exit(1);
    }
    int fd = -1;
    for (struct addrinfo *ai = res; ai; ai = ai->ai_next) {
        fd = socket(ai->ai_family, ai->ai_socktype, ai->ai_protocol);
        if (fd < 0)
            continue;
        if (connect(fd, ai->ai_addr, ai->ai_addrlen) == 0)
            break;
        close(fd);
        fd = -1;
    }
    freeaddrinfo(res);
    if (fd < 0)
        die("connect");
    set_nodelay(fd);
    return fd;
}

static void send_hello(int fd, uint32_t mode, uint64_t size, uint64_t count,
                       uint64_t flags)
{
    unsigned char hello[HELLO_LEN];
    memset(hello, 0, sizeof hello);
    put_u32(hello, HELLO_MAGIC);
    put_u32(hello + 4, mode);
    put_u64(hello + 8, size);
    put_u64(hello + 16, count);
    put_u64(hello + 24, flags);
    if (write_full(fd, hello, sizeof hello) != 0)
        die("send hello");
}

static int run_client(const char *host, unsigned port, uint64_t size, uint64_t iters,
                      uint64_t warmup, int spin)
{
    if (size == 0 || size > MAX_MSG || iters == 0) {
        fprintf(stderr, "tcp_pingpong: need 0 < --size <= 1 GiB and --iters > 0\n");
        return 2;
    }
    int fd = connect_to(host, port);
    send_hello(fd, MODE_PINGPONG, size, warmup + iters, spin ? FLAG_SPIN : 0);
    unsigned char *out = malloc((size_t)size), *in = malloc((size_t)size);
    double *rtt = malloc((size_t)iters * sizeof *rtt);
    if (!out || !in || !rtt)
        die("malloc");
    for (uint64_t i = 0; i < size; i++)
        out[i] = (unsigned char)(i * 31u + 7u);
    for (uint64_t i = 0; i < warmup + iters; i++) {
        out[0] = (unsigned char)i;
        double t0 = now_us();
        if (write_full(fd, out, (size_t)size) != 0)
            die("send");
        if (read_full_mode(fd, in, (size_t)size, spin) != 0)
            die(errno ? "recv" : "recv (server closed)");
        double t1 = now_us();
        if (in[0] != out[0] || in[size - 1] != out[size - 1]) {
            fprintf(stderr, "tcp_pingpong: echo mismatch at iteration %llu\n",
                    (unsigned long long)i);
            return 1;
        }
        if (i >= warmup)
            rtt[i - warmup] = t1 - t0;
    }
    close(fd);
    double sum = 0.0;
    for (uint64_t i = 0; i < iters; i++)
        sum += rtt[i];
    qsort(rtt, (size_t)iters, sizeof *rtt, cmp_double);
    printf("{\"mode\":\"pingpong\",\"size\":%llu,\"iters\":%llu,\"p50_us\":%.3f,"
           "\"p99_us\":%.3f,\"mean_us\":%.3f,\"min_us\":%.3f,\"max_us\":%.3f,"
           "\"spin\":%d}\n",
           (unsigned long long)size, (unsigned long long)iters,
           percentile(rtt, (size_t)iters, 50.0), percentile(rtt, (size_t)iters, 99.0),
           sum / (double)iters, rtt[0], rtt[iters - 1], spin);
    fflush(stdout);
    free(out);
    free(in);
    free(rtt);
    return 0;
}

static int run_stream(const char *host, unsigned port, uint64_t total, uint64_t wsize)
{
    if (total == 0 || wsize == 0 || wsize > MAX_MSG) {
        fprintf(stderr, "tcp_pingpong: need --bytes > 0 and 0 < --write-size <= 1 GiB\n");
        return 2;
    }
    int fd = connect_to(host, port);
    send_hello(fd, MODE_STREAM, total, wsize, 0);
    unsigned char *buf = malloc((size_t)wsize);
    if (!buf)
        die("malloc");
    for (uint64_t i = 0; i < wsize; i++)
        buf[i] = (unsigned char)(i * 131u + 1u);
    double t0 = now_us();
    uint64_t sent = 0;
    while (sent < total) {
        size_t n = (total - sent) < wsize ? (size_t)(total - sent) : (size_t)wsize;
        if (write_full(fd, buf, n) != 0)
            die("send");
        sent += n;
    }
    unsigned char ack[8];
    if (read_full(fd, ack, sizeof ack) != 0)
        die(errno ? "recv ack" : "recv ack (server closed)");
    double t1 = now_us();
    close(fd);
    uint64_t got = get_u64(ack);
    if (got != total) {
        fprintf(stderr, "tcp_pingpong: server received %llu of %llu bytes\n",
                (unsigned long long)got, (unsigned long long)total);
        return 1;
    }
    double secs = (t1 - t0) / 1e6;
    printf("{\"mode\":\"stream\",\"bytes\":%llu,\"write_size\":%llu,\"seconds\":%.6f,"
           "\"gbps\":%.4f}\n",
           (unsigned long long)total, (unsigned long long)wsize, secs,
           (double)total / secs / 1e9);
    fflush(stdout);
    free(buf);
    return 0;
}

int main(int argc, char **argv)
{
    if (argc < 2)
        usage();
    const char *mode = argv[1];
    const char *host = "127.0.0.1", *bind_addr = "127.0.0.1";
    unsigned long long port = 0, size = 4096, iters = 10000, warmup = ULLONG_MAX;
    unsigned long long bytes = 1ull << 30, wsize = 65536;
    int once = 0, have_port = 0, spin = 0;

    for (int i = 2; i < argc; i++) {
        const char *a = argv[i];
        if (strcmp(a, "--once") == 0) {
            once = 1;
            continue;
        }
        if (strcmp(a, "--spin") == 0) {
            spin = 1;
            continue;
        }
        if (strcmp(a, "-h") == 0 || strcmp(a, "--help") == 0)
            usage();
        if (i + 1 >= argc) {
            fprintf(stderr, "tcp_pingpong: %s needs a value\n", a);
            usage();
        }
        const char *v = argv[++i];
        if (strcmp(a, "--host") == 0)
            host = v;
        else if (strcmp(a, "--bind") == 0)
            bind_addr = v;
        else if (strcmp(a, "--port") == 0) {
            port = parse_u64(v, a);
            have_port = 1;
        } else if (strcmp(a, "--size") == 0)
            size = parse_u64(v, a);
        else if (strcmp(a, "--iters") == 0)
            iters = parse_u64(v, a);
        else if (strcmp(a, "--warmup") == 0)
            warmup = parse_u64(v, a);
        else if (strcmp(a, "--bytes") == 0)
            bytes = parse_u64(v, a);
        else if (strcmp(a, "--write-size") == 0)
            wsize = parse_u64(v, a);
        else {
            fprintf(stderr, "tcp_pingpong: unknown option %s\n", a);
            usage();
        }
    }
    if (port > 65535) {
        fprintf(stderr, "tcp_pingpong: bad --port\n");
        return 2;
    }
    if (iters > (1ull << 28)) {
        fprintf(stderr, "tcp_pingpong: --iters too large\n");
        return 2;
    }
    if (warmup == ULLONG_MAX)
        warmup = iters / 10 < 1000 ? iters / 10 : 1000;
    signal(SIGPIPE, SIG_IGN);

    if (strcmp(mode, "server") == 0 || strcmp(mode, "stream-server") == 0)
        return run_server(bind_addr, (unsigned)port, once);
    if (!have_port || port == 0) {
        fprintf(stderr, "tcp_pingpong: %s needs --port\n", mode);
        return 2;
    }
    if (strcmp(mode, "client") == 0)
        return run_client(host, (unsigned)port, size, iters, warmup, spin);
    if (strcmp(mode, "stream") == 0 || strcmp(mode, "stream-client") == 0)
        return run_stream(host, (unsigned)port, bytes, wsize);
    usage();
    return 2;
}
