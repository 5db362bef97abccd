/* The latency probe: an open-loop publisher and a subscriber in one small C process.
 *
 * Theory of operation
 * -------------------
 * bench/probe/__init__.py builds this file with the machine's `cc -O2` and runs it
 * once per latency run. For a server, the Python side opens and sets up every
 * connection with the harness's drivers (bench/harness/loadgen.py: handshakes,
 * subscriptions confirmed), then hands the connected sockets to this program as
 * inherited file descriptors, with the pre-encoded publish (`--template`, hex) and
 * the offset of its payload (`--due-offset`). So the protocols' set-up has one owner,
 * in Python, and this program holds only the timed part:
 *
 * - the sender thread owns the schedule: message i is due at start + i / rate
 *   (CLOCK_MONOTONIC ns). It sleeps until the next message is due
 *   (clock_nanosleep, TIMER_ABSTIME), then writes every message due by now in one
 *   write, each carrying its own *due* time in the first 8 bytes of its payload. A
 *   server (or this sender) that stalls cannot hide the stall: messages sent late
 *   keep their due times (coordinated omission avoided).
 * - the receiver thread waits on epoll over the subscriber connections (and the
 *   publisher's, whose replies it reads and drops), parses each protocol's
 *   deliveries incrementally and records `receive time - due` in a log-linear
 *   histogram laid out exactly like HdrHistogram's (1 ns .. 60 s, 3 significant
 *   digits), so the Python side loads the nonzero buckets into an `hdrh`
 *   HdrHistogram unchanged. Every delivery read by one read() gets the time taken
 *   right after that read. Samples due before the warm-up ends are counted but not
 *   recorded.
 * - mode `echo` is the floor: no broker, the same sender and receiver through a
 *   trivial echo thread over loopback TCP (its own listener), which writes each
 *   read to each of the N receiver connections.
 *
 * The receiver stops once every expected delivery (sent x fan-out) is in, or when
 * nothing arrived for --drain seconds after the last send, or --drain-max seconds
 * after it whatever still arrives (a server that fell behind: it did not keep up). One JSON line goes to
 * stdout: counts, the rate achieved, the histogram's nonzero buckets as
 * [value, count] pairs (the lowest value of each bucket), and each thread's CPU.
 */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

enum { BROKY, NATS, REDIS, ECHO };
#define MAX_SUBS 256
#define RECV_BUF (1 << 20)

/* ------------------------------------------------------------ histogram (HdrHistogram layout) */

#define H_LOWEST 1
#define H_HIGHEST 60000000000LL
#define H_SUB_BUCKET_COUNT_MAGNITUDE 11 /* ceil(log2(2 * 10^3)) */
#define H_SUB_HALF_MAGNITUDE (H_SUB_BUCKET_COUNT_MAGNITUDE - 1)
#define H_SUB_COUNT (1 << H_SUB_BUCKET_COUNT_MAGNITUDE)
#define H_SUB_HALF (H_SUB_COUNT / 2)
#define H_MASK ((int64_t)(H_SUB_COUNT - 1))

static int h_bucket_count;
static int64_t *h_counts;
static int h_len;

static void h_init(void) {
    int64_t smallest_untrackable = H_SUB_COUNT;
    int buckets = 1;
    while (smallest_untrackable <= H_HIGHEST) {
        smallest_untrackable <<= 1;
        buckets++;
    }
    h_bucket_count = buckets;
    h_len = (buckets + 1) * H_SUB_HALF;
    h_counts = calloc((size_t)h_len, sizeof(int64_t));
    if (!h_counts) abort();
}

static int h_index(int64_t v) {
    int pow2ceiling = 64 - __builtin_clzll((uint64_t)(v | H_MASK));
    int bucket = pow2ceiling - (H_SUB_HALF_MAGNITUDE + 1);
    int sub = (int)(v >> bucket);
    return ((bucket + 1) << H_SUB_HALF_MAGNITUDE) + (sub - H_SUB_HALF);
}

static int64_t h_value(int index) {
    int bucket = (index >> H_SUB_HALF_MAGNITUDE) - 1;
    int sub = (index & (H_SUB_HALF - 1)) + H_SUB_HALF;
    if (bucket < 0) {
        sub -= H_SUB_HALF;
        bucket = 0;
    }
    return (int64_t)sub << bucket;
}

/* ------------------------------------------------------------ settings and state */

static int mode = -1;
static int pub_fd = -1;
static int sub_fds[MAX_SUBS];
static int nsubs;
static uint8_t *tmpl;
static size_t tmpl_len;
static size_t due_off;     /* where the due time goes inside the publish */
static size_t rec_len;     /* broky/echo: length of one delivery */
static size_t rec_due_off; /* broky/echo: offset of the due time inside a delivery */
static double rate = 1000;
static int64_t count = 1000;
static double warmup_s = 0;
static double drain_s = 1.0;
static double drain_max_s = 10.0;
static int cpu_send = -1, cpu_recv = -1, cpu_echo = -1;
static int64_t spin_ns = 0;
static int echo_fanout = 1;
static size_t echo_size = 100;

static int64_t start_ns, record_from_ns;
static atomic_llong sent;
static atomic_int send_done;
static atomic_int pongs_owed; /* NATS PINGs to the publisher: the sender answers, between messages */
static int64_t send_end_ns, send_lag_max_ns, send_lag_sum_ns, writes;
static double sender_cpu, receiver_cpu, echo_cpu;
static int64_t received, recorded, foreign_units, errors, pub_bytes, min_ns = INT64_MAX, max_ns;
static char first_error[200];

static int64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

static double thread_cpu(void) {
    struct rusage ru;
    getrusage(RUSAGE_THREAD, &ru);
    return ru.ru_utime.tv_sec + ru.ru_stime.tv_sec + (ru.ru_utime.tv_usec + ru.ru_stime.tv_usec) / 1e6;
}

static void die(const char *what) {
    fprintf(stderr, "probe: %s: %s\n", what, strerror(errno));
    exit(2);
}

static void pin(int cpu) {
    if (cpu < 0) return;
    cpu_set_t set;
    CPU_ZERO(&set);
    CPU_SET(cpu, &set);
    if (sched_setaffinity(0, sizeof set, &set) != 0) die("sched_setaffinity");
}

static void error_note(const char *text) {
    if (errors++ == 0) snprintf(first_error, sizeof first_error, "%s", text);
}

static void write_all(int fd, const uint8_t *p, size_t n) {
    while (n) {
        ssize_t w = write(fd, p, n);
        if (w < 0) {
            if (errno == EINTR) continue;
            if (errno == EAGAIN) { /* a non-blocking fd shared with the receiver: wait */
                struct timespec t = {0, 20000};
                nanosleep(&t, NULL);
                continue;
            }
            die("write");
        }
        p += w;
        n -= (size_t)w;
    }
}

static int64_t due_of(int64_t i) { return start_ns + (int64_t)((double)i * 1e9 / rate); }

/* ------------------------------------------------------------ sender */

static void *sender(void *arg) {
    (void)arg;
    pin(cpu_send);
    /* wake when due: the default timer slack (50 µs) would add up to that to every latency */
    prctl(PR_SET_TIMERSLACK, 1UL, 0, 0, 0);
    size_t cap = (256 * 1024) / tmpl_len;
    if (cap < 1) cap = 1;
    if (cap > 4096) cap = 4096;
    uint8_t *out = malloc(cap * tmpl_len);
    if (!out) abort();
    for (size_t k = 0; k < cap; k++) memcpy(out + k * tmpl_len, tmpl, tmpl_len);
    /* --spin-us: sleep until shortly before a message is due, then spin; at most a tenth of
       the interval between two messages, so the sender never takes more than ~10% of a core */
    int64_t spin = spin_ns < (int64_t)(1e8 / rate) ? spin_ns : (int64_t)(1e8 / rate);
    int64_t i = 0;
    while (i < count) {
        int64_t due = due_of(i);
        int64_t wake = due - spin;
        struct timespec ts = {wake / 1000000000LL, wake % 1000000000LL};
        while (clock_nanosleep(CLOCK_MONOTONIC, TIMER_ABSTIME, &ts, NULL) == EINTR) {
        }
        int64_t now = now_ns();
        while (now < due) now = now_ns();
        if (now - due > send_lag_max_ns) send_lag_max_ns = now - due;
        send_lag_sum_ns += now - due;
        size_t n = 0;
        while (i < count && n < cap && (due = due_of(i)) <= now) {
            memcpy(out + n * tmpl_len + due_off, &due, 8); /* little-endian machines only */
            n++;
            i++;
        }
        int pongs = atomic_exchange(&pongs_owed, 0);
        write_all(pub_fd, out, n * tmpl_len);
        while (pongs-- > 0) write_all(pub_fd, (const uint8_t *)"PONG\r\n", 6);
        writes++;
        atomic_store(&sent, i);
    }
    send_end_ns = now_ns();
    sender_cpu = thread_cpu();
    atomic_store(&send_done, 1);
    free(out);
    return NULL;
}

/* ------------------------------------------------------------ echo (the floor) */

static int echo_in = -1;
static int echo_out[MAX_SUBS];

static void *echo(void *arg) {
    (void)arg;
    pin(cpu_echo);
    uint8_t *buf = malloc(RECV_BUF);
    if (!buf) abort();
    for (;;) {
        ssize_t r = read(echo_in, buf, RECV_BUF);
        if (r < 0 && errno == EINTR) continue;
        if (r <= 0) break;
        for (int k = 0; k < echo_fanout; k++) write_all(echo_out[k], buf, (size_t)r);
    }
    echo_cpu = thread_cpu();
    free(buf);
    return NULL;
}

static int tcp_nodelay(int fd) {
    int one = 1;
    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    return fd;
}

static void echo_setup(void) {
    int lfd = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    socklen_t alen = sizeof a;
    if (lfd < 0 || bind(lfd, (struct sockaddr *)&a, sizeof a) || listen(lfd, 64) ||
        getsockname(lfd, (struct sockaddr *)&a, &alen))
        die("echo listener");
    int *client = malloc(sizeof(int) * (size_t)(echo_fanout + 1));
    for (int k = 0; k <= echo_fanout; k++) { /* k = 0: the publisher, then the receivers */
        client[k] = tcp_nodelay(socket(AF_INET, SOCK_STREAM, 0));
        if (connect(client[k], (struct sockaddr *)&a, sizeof a)) die("echo connect");
        int s = accept(lfd, NULL, NULL);
        if (s < 0) die("echo accept");
        tcp_nodelay(s);
        if (k == 0) {
            pub_fd = client[0];
            echo_in = s;
        } else {
            sub_fds[nsubs++] = client[k];
            echo_out[k - 1] = s;
        }
    }
    close(lfd);
    free(client);
    tmpl_len = echo_size;
    tmpl = calloc(1, tmpl_len);
    due_off = 0;
    rec_len = echo_size;
    rec_due_off = 0;
}

/* ------------------------------------------------------------ receiver */

struct conn {
    int fd;
    int is_pub;
    size_t fill;
    uint8_t *buf;
};

static inline void deliver(const uint8_t *due_at, int64_t now) {
    int64_t due;
    memcpy(&due, due_at, 8);
    received++;
    if (due < record_from_ns) return;
    int64_t v = now - due;
    if (v < H_LOWEST) v = H_LOWEST;
    if (v > H_HIGHEST) v = H_HIGHEST;
    h_counts[h_index(v)]++;
    recorded++;
    if (v < min_ns) min_ns = v;
    if (v > max_ns) max_ns = v;
}

static const uint8_t *find_crlf(const uint8_t *p, size_t n) {
    const uint8_t *q = memchr(p, '\r', n);
    while (q && (size_t)(q - p) + 1 < n) {
        if (q[1] == '\n') return q;
        q = memchr(q + 1, '\r', n - (size_t)(q + 1 - p));
    }
    return NULL;
}

/* RESP: "<c><int>\r\n" at p; returns bytes used, 0 if incomplete. */
static size_t resp_int(const uint8_t *p, size_t n, char c, int64_t *v) {
    if (n < 1) return 0;
    if (p[0] != c) return (size_t)-1;
    const uint8_t *e = find_crlf(p, n);
    if (!e) return 0;
    *v = strtoll((const char *)p + 1, NULL, 10);
    return (size_t)(e - p) + 2;
}

/* One unit at p (n bytes available): its length, 0 if it is not complete yet. */
static size_t parse_unit(struct conn *c, const uint8_t *p, size_t n, int64_t now) {
    switch (mode) {
    case ECHO:
        if (n < rec_len) return 0;
        deliver(p + rec_due_off, now);
        return rec_len;
    case BROKY: {
        if (n < 4) return 0;
        uint32_t size;
        memcpy(&size, p, 4);
        size_t len = (size_t)size + 4;
        if (n < len) return 0;
        /* a Message of this run has the publisher's frame length; anything else (Pong,
           LossNotice, Error) is counted as foreign */
        if (len == rec_len && len >= rec_due_off + 8)
            deliver(p + rec_due_off, now);
        else
            foreign_units++;
        return len;
    }
    case NATS: {
        const uint8_t *e = find_crlf(p, n);
        if (!e) return 0;
        size_t line = (size_t)(e - p);
        if (line > 4 && memcmp(p, "MSG ", 4) == 0) {
            const uint8_t *sp = e;
            while (sp > p && sp[-1] != ' ') sp--;
            size_t bytes = (size_t)strtoull((const char *)sp, NULL, 10);
            size_t total = line + 2 + bytes + 2;
            if (n < total) return 0;
            if (bytes >= 8)
                deliver(p + line + 2, now);
            else
                error_note("nats: a MSG too short to carry a due time");
            return total;
        }
        if (line == 4 && memcmp(p, "PING", 4) == 0)
            write_all(c->fd, (const uint8_t *)"PONG\r\n", 6);
        else if (line >= 4 && memcmp(p, "-ERR", 4) == 0)
            error_note("nats: -ERR");
        else
            foreign_units++; /* PONG, +OK, INFO */
        return line + 2;
    }
    case REDIS: {
        int64_t parts, len;
        size_t used = resp_int(p, n, '*', &parts);
        if (used == 0) return 0;
        if (used == (size_t)-1 || parts < 1 || parts > 4) {
            error_note("redis: a push that is not an array of 3 or 4 bulk strings");
            return n;
        }
        size_t pos = used;
        const uint8_t *last = NULL;
        size_t last_len = 0;
        for (int64_t k = 0; k < parts; k++) {
            size_t u = resp_int(p + pos, n - pos, '$', &len);
            if (u == 0) return 0;
            if (u == (size_t)-1 || len < 0) {
                error_note("redis: unexpected RESP element");
                return n;
            }
            if (n < pos + u + (size_t)len + 2) return 0;
            last = p + pos + u;
            last_len = (size_t)len;
            pos += u + (size_t)len + 2;
        }
        if ((parts == 3 && memcmp(p + used, "$7\r\nmessage", 11) == 0) ||
            (parts == 4 && memcmp(p + used, "$8\r\npmessage", 12) == 0)) {
            if (last_len >= 8)
                deliver(last, now);
            else
                error_note("redis: a message too short to carry a due time");
        } else {
            foreign_units++;
        }
        return pos;
    }
    }
    return n;
}

static int read_conn(struct conn *c) {
    ssize_t r = read(c->fd, c->buf + c->fill, RECV_BUF - c->fill);
    int64_t now = now_ns();
    if (r < 0) return (errno == EAGAIN || errno == EINTR) ? 1 : -1;
    if (r == 0) return -1;
    size_t end = c->fill + (size_t)r, pos = 0;
    while (pos < end) {
        size_t used = parse_unit(c, c->buf + pos, end - pos, now);
        if (used == 0) break;
        pos += used;
    }
    if (pos < end && pos) memmove(c->buf, c->buf + pos, end - pos);
    c->fill = end - pos;
    if (c->fill == RECV_BUF) {
        error_note("a unit larger than the receive buffer");
        return -1;
    }
    return 1;
}

static void receive(int64_t expected) {
    pin(cpu_recv);
    int ep = epoll_create1(0);
    struct conn *conns = calloc((size_t)nsubs + 1, sizeof *conns);
    int n = 0;
    for (int k = 0; k <= nsubs; k++) {
        int fd = k < nsubs ? sub_fds[k] : (mode == ECHO ? -1 : pub_fd);
        if (fd < 0) continue;
        conns[n].fd = fd;
        conns[n].is_pub = k == nsubs;
        conns[n].buf = malloc(RECV_BUF);
        if (!conns[n].is_pub) fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) | O_NONBLOCK);
        struct epoll_event ev = {.events = EPOLLIN, .data.ptr = &conns[n]};
        if (epoll_ctl(ep, EPOLL_CTL_ADD, fd, &ev)) die("epoll_ctl");
        n++;
    }
    int open = nsubs;
    int64_t give_up_ns = due_of(count) + (int64_t)((drain_max_s + 20) * 1e9);
    int64_t last_progress = now_ns();
    struct epoll_event evs[64];
    for (;;) {
        int k = epoll_wait(ep, evs, 64, 20);
        if (k < 0 && errno != EINTR) die("epoll_wait");
        int64_t before = received;
        for (int j = 0; j < k; j++) {
            struct conn *c = evs[j].data.ptr;
            if (c->is_pub) {
                /* replies to the publisher (Redis's ":<receivers>" per PUBLISH, NATS's PINGs;
                   Broky sends none): read and drop. Its fd stays blocking for the sender, hence
                   MSG_DONTWAIT; nothing is written to it from this thread (the sender answers
                   PINGs between two writes of messages). */
                ssize_t r = recv(c->fd, c->buf, RECV_BUF, MSG_DONTWAIT);
                if (r == 0) {
                    epoll_ctl(ep, EPOLL_CTL_DEL, c->fd, NULL);
                    error_note("the server closed the publisher connection");
                } else if (r > 0) {
                    pub_bytes += r;
                    if (mode == REDIS && (c->buf[0] == '-' || memmem(c->buf, (size_t)r, "\n-", 2)))
                        error_note("redis: an error reply to PUBLISH");
                    if (mode == NATS) { /* PINGs (the server's first comes ~2 s after CONNECT) */
                        for (uint8_t *q = c->buf; (q = memmem(q, (size_t)(c->buf + r - q), "PING\r\n", 6));
                             q += 6)
                            atomic_fetch_add(&pongs_owed, 1);
                        if (memmem(c->buf, (size_t)r, "-ERR", 4)) error_note("nats: -ERR to the publisher");
                    }
                    if (mode == BROKY) error_note("broky: a frame to the publisher");
                }
                continue;
            }
            if (read_conn(c) < 0) {
                epoll_ctl(ep, EPOLL_CTL_DEL, c->fd, NULL);
                open--;
                error_note("the server closed a subscriber connection");
            }
        }
        int64_t now = now_ns();
        if (received != before) last_progress = now;
        int done = atomic_load(&send_done);
        int64_t want = done ? atomic_load(&sent) * nsubs : expected;
        if (done && received >= want) break;
        if (open == 0) break;
        if (done && now - last_progress > (int64_t)(drain_s * 1e9) && now - send_end_ns > (int64_t)(drain_s * 1e9))
            break;
        if (done && now - send_end_ns > (int64_t)(drain_max_s * 1e9)) break; /* a backlog: did not keep up */
        if (!done && now > give_up_ns) { /* the server stopped reading: the sender is stuck in write */
            error_note("the sender could not send everything (the server stopped reading)");
            break;
        }
    }
    receiver_cpu = thread_cpu();
    close(ep);
    for (int k = 0; k < n; k++) free(conns[k].buf);
    free(conns);
}

/* ------------------------------------------------------------ main */

static uint8_t *unhex(const char *s, size_t *len) {
    size_t n = strlen(s) / 2;
    uint8_t *out = malloc(n ? n : 1);
    for (size_t k = 0; k < n; k++) sscanf(s + 2 * k, "%2hhx", &out[k]);
    *len = n;
    return out;
}

static void usage(void) {
    fprintf(stderr,
            "usage: probe --mode broky|nats|redis|echo --rate R --count N [--warmup S] [--drain S]\n"
            "  [--drain-max S]\n"
            "  servers: --pub-fd FD --sub-fds FD,FD,... --template HEX --due-offset N\n"
            "           [--record-len N --record-due-offset N]  (broky)\n"
            "  echo:    --fanout N --size BYTES\n"
            "  [--cpu-send C] [--cpu-recv C] [--cpu-echo C] [--spin-us US]\n");
    exit(2);
}

int main(int argc, char **argv) {
    for (int k = 1; k < argc; k++) {
        const char *a = argv[k];
        if (k + 1 >= argc) usage();
        const char *v = argv[++k];
        if (!strcmp(a, "--mode")) {
            mode = !strcmp(v, "broky") ? BROKY : !strcmp(v, "nats") ? NATS : !strcmp(v, "redis") ? REDIS
                 : !strcmp(v, "echo") ? ECHO : -1;
        } else if (!strcmp(a, "--pub-fd")) pub_fd = atoi(v);
        else if (!strcmp(a, "--sub-fds")) {
            for (char *s = (char *)v; *s && nsubs < MAX_SUBS;) {
                sub_fds[nsubs++] = (int)strtol(s, &s, 10);
                if (*s == ',') s++;
            }
        } else if (!strcmp(a, "--template")) tmpl = unhex(v, &tmpl_len);
        else if (!strcmp(a, "--due-offset")) due_off = (size_t)atol(v);
        else if (!strcmp(a, "--record-len")) rec_len = (size_t)atol(v);
        else if (!strcmp(a, "--record-due-offset")) rec_due_off = (size_t)atol(v);
        else if (!strcmp(a, "--rate")) rate = atof(v);
        else if (!strcmp(a, "--count")) count = atoll(v);
        else if (!strcmp(a, "--warmup")) warmup_s = atof(v);
        else if (!strcmp(a, "--drain")) drain_s = atof(v);
        else if (!strcmp(a, "--drain-max")) drain_max_s = atof(v);
        else if (!strcmp(a, "--spin-us")) spin_ns = (int64_t)(atof(v) * 1000);
        else if (!strcmp(a, "--cpu-send")) cpu_send = atoi(v);
        else if (!strcmp(a, "--cpu-recv")) cpu_recv = atoi(v);
        else if (!strcmp(a, "--cpu-echo")) cpu_echo = atoi(v);
        else if (!strcmp(a, "--fanout")) echo_fanout = atoi(v);
        else if (!strcmp(a, "--size")) echo_size = (size_t)atol(v);
        else usage();
    }
    if (mode < 0 || rate <= 0 || count < 1) usage();
    pthread_t echo_thread;
    if (mode == ECHO) {
        if (echo_fanout < 1 || echo_fanout > MAX_SUBS || echo_size < 8) usage();
        echo_setup();
        if (pthread_create(&echo_thread, NULL, echo, NULL)) die("pthread_create");
    } else if (pub_fd < 0 || nsubs < 1 || !tmpl || due_off + 8 > tmpl_len ||
               (mode == BROKY && rec_len < rec_due_off + 8)) {
        usage();
    }
    h_init();
    /* the receiver starts waiting before the first message is due */
    start_ns = now_ns() + 20000000LL;
    record_from_ns = start_ns + (int64_t)(warmup_s * 1e9);
    pthread_t send_thread;
    if (pthread_create(&send_thread, NULL, sender, NULL)) die("pthread_create");
    receive(count * nsubs);
    if (!atomic_load(&send_done)) { /* stuck: report what was seen; exit ends the thread */
        send_end_ns = now_ns();
    } else {
        pthread_join(send_thread, NULL);
    }
    if (mode == ECHO && atomic_load(&send_done)) {
        shutdown(pub_fd, SHUT_WR); /* the echo thread reads end-of-stream and stops */
        pthread_join(echo_thread, NULL);
    }
    int64_t n_sent = atomic_load(&sent);
    double span = (send_end_ns - start_ns) / 1e9;
    printf("{\"mode\": \"%s\", \"sent\": %lld, \"fanout\": %d, \"expected\": %lld, \"received\": %lld, "
           "\"lost\": %lld, \"recorded\": %lld, \"rate\": %.1f, \"rate_achieved\": %.1f, "
           "\"send_lag_max_ns\": %lld, \"send_lag_mean_ns\": %lld, \"writes\": %lld, \"min_ns\": %lld, \"max_ns\": %lld, "
           "\"foreign\": %lld, \"publisher_reply_bytes\": %lld, \"errors\": %lld, \"first_error\": \"%s\", "
           "\"sender_cpu_s\": %.4f, \"receiver_cpu_s\": %.4f, \"echo_cpu_s\": %.4f, \"buckets\": [",
           mode == BROKY ? "broky" : mode == NATS ? "nats" : mode == REDIS ? "redis" : "echo", (long long)n_sent,
           nsubs, (long long)(n_sent * nsubs), (long long)received,
           (long long)(n_sent * nsubs > received ? n_sent * nsubs - received : 0), (long long)recorded, rate,
           n_sent > 1 && span > 0 ? (n_sent - 1) / span : 0.0, (long long)send_lag_max_ns,
           (long long)(writes ? send_lag_sum_ns / writes : 0), (long long)writes,
           (long long)(recorded ? min_ns : 0), (long long)max_ns, (long long)foreign_units, (long long)pub_bytes,
           (long long)errors, first_error, sender_cpu, receiver_cpu, echo_cpu);
    int first = 1;
    for (int k = 0; k < h_len; k++) {
        if (!h_counts[k]) continue;
        printf("%s[%lld, %lld]", first ? "" : ", ", (long long)h_value(k), (long long)h_counts[k]);
        first = 0;
    }
    printf("]}\n");
    return 0;
}
