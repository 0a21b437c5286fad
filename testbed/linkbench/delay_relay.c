/* The measured link's one-way delay, in C: the same job as relay.py, at memory speed.
 *
 * Attaches to the TUN device DEV (virtio-net header, TSO/checksum offloads: the kernel hands over GSO
 * super-packets), stamps every packet as it is read, holds it DELAY_S and writes it back, where the
 * kernel forwards it on through the rate-limiting tbf (testbed/linkbench/netns.py). Written to test
 * whether the Python relay caused the spread of 4-16 MB at 400 Mbps: it did not (2026-11-28,
 * docs/measurements/links-2026-11-28.md): both relays forward 1.2-1.5 GB/s in bulk (relay_speed.py),
 * and the 400 Mbps runs spread with either. This one stamps each packet as it is read (relay.py
 * stamps a read batch with one time).
 *
 * Left out, as in relay.py: the segments of one super-packet are delayed as one unit; the delay is
 * constant (no jitter, no reordering); a relay descheduled longer than a packet's gap adds that time
 * (`late_max_s` / `late_mean_s` in the report measure it).
 *
 * Two release modes (the third argument, default "loop"):
 *   loop  - every series to 2026-11-28e: one thread reads up to READS_PER_TURN packets, then writes the due
 *           ones. A write carries the kernel's forwarding (38-45 us at 400 Mbps), so while the relay writes
 *           a released burst, arriving packets wait unread in the TUN queue and are stamped (and released)
 *           that much later: lateness the relay's own `late_*` figures cannot see, growing with the backlog.
 *   timer - (2026-11-28f) a reader thread blocks on the TUN device and stamps each packet the moment the
 *           kernel hands it over (arrival), pushing it on a single-producer queue; the writer thread
 *           sleeps until the head's due time (arrival + DELAY_S, absolute CLOCK_MONOTONIC) and writes it.
 *           A write no longer holds up the next arrival's stamp; the release is arrival + delay.
 *           linkbench/lateness.py measures both from outside (kernel timestamps on the TUN device).
 *
 * Usage: delay_relay DEV DELAY_S [loop|timer]. Prints "ready" once attached; on SIGUSR1 one JSON line of what it
 * forwarded and how late since the last SIGUSR1 (netns.py takes one per measured run: a late run is
 * flagged, 2026-11-28c), and on SIGTERM one JSON report line of the whole life.
 * Built by netns.py with the system C compiler (gcc -O2) the first time a link needs it.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <linux/if.h>
#include <linux/if_tun.h>
#include <poll.h>
#include <pthread.h>
#include <sched.h>
#include <sys/eventfd.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

#define MAX_PACKET (65536 + 64) /* a GSO super-packet with its virtio-net header */
#define SLOTS (1 << 16)         /* packets held at once (a 50 ms delay at 400 Mbps holds ~5,000) */
#define RING_BYTES (64u << 20)  /* their bytes: a held window is a few MB */
#define READS_PER_TURN 64       /* then due packets go out: a long burst read must not delay them */
#define RT_PRIORITY 30          /* above the endpoints' (gloo_pair.py: 20), as relay.py */

struct held {
    uint64_t due_ns;
    uint32_t off, len;
};

static volatile sig_atomic_t stop, snapshot;
static void on_term(int sig) { (void)sig; stop = 1; }
static void on_usr1(int sig) { (void)sig; snapshot = 1; }

struct tally {
    uint64_t packets, nbytes, dropped, late_sum, late_max, write_ns;
};

static void count(struct tally *t, uint64_t len, uint64_t late, int drop, uint64_t write_ns) {
    t->packets++;
    t->write_ns += write_ns;
    t->nbytes += len;
    t->dropped += (uint64_t)drop;
    t->late_sum += late;
    if (late > t->late_max) t->late_max = late;
}

static void report(const struct tally *t) {
    printf("{\"packets\": %llu, \"bytes\": %llu, \"late_max_s\": %.9f, \"late_mean_s\": %.9f, \"write_drops\": %llu, "
           "\"write_s\": %.6f, \"relay\": \"c\"}\n",
           (unsigned long long)t->packets, (unsigned long long)t->nbytes, t->late_max / 1e9,
           t->packets ? t->late_sum / 1e9 / t->packets : 0.0, (unsigned long long)t->dropped, t->write_ns / 1e9);
    fflush(stdout);
}

static uint64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

static int open_tun(const char *dev) {
    int fd = open("/dev/net/tun", O_RDWR | O_NONBLOCK);
    if (fd < 0) return -1;
    struct ifreq ifr;
    memset(&ifr, 0, sizeof ifr);
    ifr.ifr_flags = IFF_TUN | IFF_NO_PI | IFF_VNET_HDR;
    strncpy(ifr.ifr_name, dev, IFNAMSIZ - 1);
    if (ioctl(fd, TUNSETIFF, &ifr) < 0) return -1;
    if (ioctl(fd, TUNSETOFFLOAD, TUN_F_CSUM | TUN_F_TSO4 | TUN_F_TSO6) < 0) return -1;
    return fd;
}

/* Where the next packet (up to MAX_PACKET bytes, contiguous) may go without overwriting a held one:
 * after the newest, or from the ring's start once the end is too short; -1 if neither is free. */
static long free_at(const struct held *q, uint32_t head, uint32_t tail, uint32_t wr) {
    if (head == tail) return 0;
    uint32_t oldest = q[head % SLOTS].off;
    if (oldest < wr) { /* held: [oldest, wr) */
        if ((uint64_t)wr + MAX_PACKET <= RING_BYTES) return wr;
        return oldest >= MAX_PACKET ? 0 : -1;
    }
    return (uint64_t)wr + MAX_PACKET <= oldest ? (long)wr : -1; /* held wraps: free is [wr, oldest) */
}

/* The relay's state: the held packets' slots [head, tail) and their bytes in `ring` (next free byte at wr). */
struct relay {
    int fd, wake; /* the TUN device; an eventfd the reader signals when the queue was empty (timer mode) */
    uint64_t delay_ns;
    unsigned char *ring;
    struct held *q;
    uint32_t head, tail, wr; /* head: writer's; tail, wr: reader's (atomics in timer mode) */
    int sleeping;            /* timer mode: the writer is (about to be) asleep on `wake` */
    struct tally life, run;
};

static void release(struct relay *r, struct held *h, uint64_t t, uint64_t *after) {
    /* the write forwards the packet inside this call (routing, tbf, the veth to the endpoint and,
     * at the endpoint, TCP's receive path run in the relay's time): write_s measures it */
    uint64_t w0 = now_ns();
    int drop = write(r->fd, r->ring + h->off, h->len) < 0; /* a full kernel queue: a router's drop */
    uint64_t w1 = now_ns();
    count(&r->life, h->len, t - h->due_ns, drop, w1 - w0);
    count(&r->run, h->len, t - h->due_ns, drop, w1 - w0);
    *after = w1;
}

static void take_snapshot(struct relay *r) {
    if (!snapshot) return;
    snapshot = 0;
    report(&r->run);
    r->run = (struct tally){0};
}

/* loop mode: read a turn's packets, then write the due ones, in one thread */
static void serve_loop(struct relay *r) {
    struct held *q = r->q;
    struct pollfd pfd = {.fd = r->fd, .events = POLLIN};
    while (!stop) {
        take_snapshot(r);
        struct timespec ts = {0, 200000000}, *tsp = &ts;
        if (r->head != r->tail) {
            uint64_t t = now_ns(), due = q[r->head % SLOTS].due_ns;
            uint64_t wait = due > t ? due - t : 0;
            ts.tv_sec = (time_t)(wait / 1000000000u);
            ts.tv_nsec = (long)(wait % 1000000000u);
        }
        /* full (never seen: a held window is a few MB): wait for the head's due time, not for input */
        pfd.events = (r->tail - r->head < SLOTS && free_at(q, r->head, r->tail, r->wr) >= 0) ? POLLIN : 0;
        int ready = ppoll(&pfd, 1, tsp, NULL);
        if (ready < 0 && errno != EINTR) break;
        for (int i = 0; ready > 0 && pfd.events && i < READS_PER_TURN && r->tail - r->head < SLOTS; i++) {
            long off = free_at(q, r->head, r->tail, r->wr);
            if (off < 0) break; /* the ring is full: leave the packets in the kernel's queue */
            ssize_t n = read(r->fd, r->ring + off, MAX_PACKET);
            if (n <= 0) break;
            q[r->tail % SLOTS] = (struct held){now_ns() + r->delay_ns, (uint32_t)off, (uint32_t)n};
            r->tail++;
            r->wr = (uint32_t)off + (uint32_t)n;
        }
        uint64_t t = now_ns();
        while (r->head != r->tail && q[r->head % SLOTS].due_ns <= t) {
            release(r, &q[r->head % SLOTS], t, &t);
            r->head++;
        }
    }
}

/* timer mode, reader thread: stamp each packet as the kernel hands it over, queue it, wake the writer */
static void *reader(void *arg) {
    struct relay *r = arg;
    struct pollfd pfd = {.fd = r->fd, .events = POLLIN};
    while (!stop) {
        if (poll(&pfd, 1, 200) <= 0) continue;
        for (;;) {
            uint32_t head = __atomic_load_n(&r->head, __ATOMIC_ACQUIRE), tail = r->tail;
            long off = tail - head < SLOTS ? free_at(r->q, head, tail, r->wr) : -1;
            if (off < 0) { /* full (never seen): let the writer free a slot */
                usleep(50);
                break;
            }
            ssize_t n = read(r->fd, r->ring + off, MAX_PACKET);
            if (n <= 0) break;
            r->q[tail % SLOTS] = (struct held){now_ns() + r->delay_ns, (uint32_t)off, (uint32_t)n};
            r->wr = (uint32_t)off + (uint32_t)n;
            __atomic_store_n(&r->tail, tail + 1, __ATOMIC_SEQ_CST);
            /* the writer may be asleep on an empty queue: it says so before its last look at `tail` */
            if (__atomic_load_n(&r->sleeping, __ATOMIC_SEQ_CST)) {
                uint64_t one = 1;
                (void)!write(r->wake, &one, sizeof one);
            }
        }
    }
    return NULL;
}

/* timer mode, writer (main) thread: sleep to the head's due time (absolute), write it */
static void serve_timer(struct relay *r) {
    struct pollfd pfd = {.fd = r->wake, .events = POLLIN};
    while (!stop) {
        take_snapshot(r);
        uint32_t tail = __atomic_load_n(&r->tail, __ATOMIC_ACQUIRE);
        if (r->head == tail) {
            __atomic_store_n(&r->sleeping, 1, __ATOMIC_SEQ_CST);
            if (__atomic_load_n(&r->tail, __ATOMIC_SEQ_CST) == r->head
                && ppoll(&pfd, 1, &(struct timespec){0, 200000000}, NULL) > 0) {
                uint64_t v;
                (void)!read(r->wake, &v, sizeof v);
            }
            __atomic_store_n(&r->sleeping, 0, __ATOMIC_SEQ_CST);
            continue;
        }
        struct held *h = &r->q[r->head % SLOTS];
        struct timespec due = {(time_t)(h->due_ns / 1000000000u), (long)(h->due_ns % 1000000000u)};
        if (clock_nanosleep(CLOCK_MONOTONIC, TIMER_ABSTIME, &due, NULL) == EINTR) continue;
        uint64_t t = now_ns();
        release(r, h, t, &t);
        __atomic_store_n(&r->head, r->head + 1, __ATOMIC_RELEASE);
    }
}

int main(int argc, char **argv) {
    if (argc != 3 && argc != 4) {
        fprintf(stderr, "usage: delay_relay DEV DELAY_S [loop|timer]\n");
        return 2;
    }
    const char *mode = argc == 4 ? argv[3] : "loop";
    if (strcmp(mode, "loop") && strcmp(mode, "timer")) {
        fprintf(stderr, "error: mode %s: valid choices: loop, timer\n", mode);
        return 2;
    }
    double delay_s = strtod(argv[2], NULL);
    if (!(delay_s >= 0 && delay_s < 10)) {
        fprintf(stderr, "error: DELAY_S %s: seconds in [0, 10)\n", argv[2]);
        return 2;
    }
    struct relay r = {.delay_ns = (uint64_t)(delay_s * 1e9 + 0.5)};
    r.fd = open_tun(argv[1]);
    if (r.fd < 0) {
        printf("error: cannot attach to TUN device %s: %s\n", argv[1], strerror(errno));
        return 1;
    }
    r.ring = malloc(RING_BYTES);
    r.q = calloc(SLOTS, sizeof *r.q);
    r.wake = eventfd(0, EFD_NONBLOCK);
    if (!r.ring || !r.q || r.wake < 0) {
        printf("error: out of memory\n");
        return 1;
    }
    memset(r.ring, 0, RING_BYTES); /* touch the pages now, not on the first burst */
    mlockall(MCL_CURRENT);
    struct sched_param sp = {.sched_priority = RT_PRIORITY};
    sched_setscheduler(0, SCHED_FIFO, &sp); /* best effort, as relay.py; the reader thread inherits it */
    signal(SIGTERM, on_term);
    signal(SIGINT, on_term);
    struct sigaction su = {.sa_handler = on_usr1}; /* no SA_RESTART: ppoll returns EINTR at once */
    sigaction(SIGUSR1, &su, NULL);
    pthread_t rd;
    if (!strcmp(mode, "timer")) {
        sigset_t all, old;
        sigfillset(&all);
        pthread_sigmask(SIG_BLOCK, &all, &old); /* signals go to the writer (main) thread */
        pthread_attr_t at;
        pthread_attr_init(&at);
        pthread_attr_setinheritsched(&at, PTHREAD_INHERIT_SCHED);
        if (pthread_create(&rd, &at, reader, &r)) {
            printf("error: cannot start the reader thread\n");
            return 1;
        }
        pthread_sigmask(SIG_SETMASK, &old, NULL);
    }
    printf("ready\n");
    fflush(stdout);
    if (!strcmp(mode, "timer")) {
        serve_timer(&r);
        pthread_join(rd, NULL);
    } else {
        serve_loop(&r);
    }
    report(&r.life);
    return 0;
}
