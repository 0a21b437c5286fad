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
 * Usage: delay_relay DEV DELAY_S. Prints "ready" once attached; on SIGUSR1 one JSON line of what it
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
#include <sched.h>
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

int main(int argc, char **argv) {
    if (argc != 3) {
        fprintf(stderr, "usage: delay_relay DEV DELAY_S\n");
        return 2;
    }
    double delay_s = strtod(argv[2], NULL);
    if (!(delay_s >= 0 && delay_s < 10)) {
        fprintf(stderr, "error: DELAY_S %s: seconds in [0, 10)\n", argv[2]);
        return 2;
    }
    uint64_t delay_ns = (uint64_t)(delay_s * 1e9 + 0.5);
    int fd = open_tun(argv[1]);
    if (fd < 0) {
        printf("error: cannot attach to TUN device %s: %s\n", argv[1], strerror(errno));
        return 1;
    }
    unsigned char *ring = malloc(RING_BYTES);
    struct held *q = calloc(SLOTS, sizeof *q);
    if (!ring || !q) {
        printf("error: out of memory\n");
        return 1;
    }
    memset(ring, 0, RING_BYTES); /* touch the pages now, not on the first burst */
    mlockall(MCL_CURRENT);
    struct sched_param sp = {.sched_priority = RT_PRIORITY};
    sched_setscheduler(0, SCHED_FIFO, &sp); /* best effort, as relay.py */
    signal(SIGTERM, on_term);
    signal(SIGINT, on_term);
    struct sigaction su = {.sa_handler = on_usr1}; /* no SA_RESTART: ppoll returns EINTR at once */
    sigaction(SIGUSR1, &su, NULL);
    printf("ready\n");
    fflush(stdout);

    uint32_t head = 0, tail = 0, wr = 0; /* slots [head, tail); next byte to fill at wr */
    struct tally life = {0}, run = {0};
    struct pollfd pfd = {.fd = fd, .events = POLLIN};
    while (!stop) {
        if (snapshot) {
            snapshot = 0;
            report(&run);
            run = (struct tally){0};
        }
        struct timespec ts = {0, 200000000}, *tsp = &ts;
        if (head != tail) {
            uint64_t t = now_ns(), due = q[head % SLOTS].due_ns;
            uint64_t wait = due > t ? due - t : 0;
            ts.tv_sec = (time_t)(wait / 1000000000u);
            ts.tv_nsec = (long)(wait % 1000000000u);
        }
        /* full (never seen: a held window is a few MB): wait for the head's due time, not for input */
        pfd.events = (tail - head < SLOTS && free_at(q, head, tail, wr) >= 0) ? POLLIN : 0;
        int ready = ppoll(&pfd, 1, tsp, NULL);
        if (ready < 0 && errno != EINTR) break;
        for (int i = 0; ready > 0 && pfd.events && i < READS_PER_TURN && tail - head < SLOTS; i++) {
            long off = free_at(q, head, tail, wr);
            if (off < 0) break; /* the ring is full: leave the packets in the kernel's queue */
            ssize_t n = read(fd, ring + off, MAX_PACKET);
            if (n <= 0) break;
            q[tail % SLOTS] = (struct held){now_ns() + delay_ns, (uint32_t)off, (uint32_t)n};
            tail++;
            wr = (uint32_t)off + (uint32_t)n;
        }
        uint64_t t = now_ns();
        while (head != tail && q[head % SLOTS].due_ns <= t) {
            struct held *h = &q[head % SLOTS];
            /* the write forwards the packet inside this call (routing, tbf, the veth to the endpoint and,
             * at the endpoint, TCP's receive path run in the relay's time): write_s measures it */
            uint64_t w0 = now_ns();
            int drop = write(fd, ring + h->off, h->len) < 0; /* a full kernel queue: a router's drop */
            uint64_t w1 = now_ns();
            count(&life, h->len, t - h->due_ns, drop, w1 - w0);
            count(&run, h->len, t - h->due_ns, drop, w1 - w0);
            head++;
            t = w1;
        }
    }
    report(&life);
    return 0;
}
