/* The floor of a TCP-terminating relay: a port forward with no logic at all, for
 * benchmarks/egress.py's relay section.
 *
 *     floor_relay [--connect] LISTEN_PORT UPSTREAM_ADDR UPSTREAM_PORT [LISTEN_ADDR]
 *
 * Listens on LISTEN_ADDR:LISTEN_PORT (127.0.0.1 unless given; port 0: an ephemeral one) and
 * prints the port it got on stdout. WORKERS processes, forked at the start (none per
 * connection), each accept one connection at a time, connect to UPSTREAM_ADDR:UPSTREAM_PORT
 * and move the bytes both ways with splice(2) through a pipe per way, in one poll(2) loop: no
 * copy to user space, no parsing. TCP_NODELAY on both sockets from the start. A way whose
 * reader sees EOF is passed on as shutdown(SHUT_WR) once its pipe is empty; a connection ends
 * when both ways have ended, or at its first error. The workers die with the first process
 * (PR_SET_PDEATHSIG).
 *
 * --connect: the floor of an HTTP CONNECT proxy. Each connection's head (up to its blank
 * line) is read first and not parsed, whatever host it names; then the upstream connect,
 * "200 Connection established", and the relay as above (any bytes sent after the head go
 * on first). */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <unistd.h>

#define PIPE_BYTES (1 << 20)
#define WORKERS 4
#define HEAD_BYTES 8192

static int connect_mode; /* --connect: a CONNECT head is read and answered first */

struct way {
    int from, to, pipe[2];
    size_t held, room; /* bytes in the pipe, and its size */
    int eof, done;
};

static void die(const char *what) {
    perror(what);
    exit(1);
}

static void nodelay(int fd) {
    int one = 1;
    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
}

static int way_open(struct way *w, int from, int to) {
    w->from = from, w->to = to, w->held = 0, w->eof = 0, w->done = 0;
    if (pipe2(w->pipe, O_NONBLOCK) < 0) return -1;
    int size = fcntl(w->pipe[1], F_SETPIPE_SZ, PIPE_BYTES);
    w->room = size > 0 ? (size_t)size : (size_t)fcntl(w->pipe[1], F_GETPIPE_SZ);
    return 0;
}

/* Moves what it can without blocking: socket into pipe, pipe into socket. -1: a reset. */
static int way_step(struct way *w, short from_events) {
    unsigned flags = SPLICE_F_MOVE | SPLICE_F_NONBLOCK;
    if (!w->eof && w->held < w->room && (from_events & (POLLIN | POLLHUP))) {
        ssize_t n = splice(w->from, NULL, w->pipe[1], NULL, w->room - w->held, flags);
        if (n == 0) w->eof = 1;
        else if (n > 0) w->held += (size_t)n;
        else if (errno != EAGAIN) return -1;
    }
    while (w->held > 0) {
        ssize_t n = splice(w->pipe[0], NULL, w->to, NULL, w->held, flags);
        if (n > 0) w->held -= (size_t)n;
        else if (n < 0 && errno == EAGAIN) break;
        else return -1;
    }
    if (w->eof && w->held == 0 && !w->done) {
        shutdown(w->to, SHUT_WR);
        w->done = 1;
    }
    return 0;
}

/* Sends all of buf on a blocking socket; -1 on an error. */
static int send_all(int fd, const char *buf, size_t len) {
    while (len > 0) {
        ssize_t n = send(fd, buf, len, MSG_NOSIGNAL);
        if (n < 0) return -1;
        buf += n, len -= (size_t)n;
    }
    return 0;
}

/* Reads the client's head up to its blank line into buf; the bytes read past it are at
 * *rest (*rest_len of them). -1: the client ended or sent no blank line in HEAD_BYTES. */
static int read_head(int client, char *buf, const char **rest, size_t *rest_len) {
    size_t got = 0;
    while (got < HEAD_BYTES) {
        ssize_t n = recv(client, buf + got, HEAD_BYTES - got, 0);
        if (n <= 0) return -1;
        got += (size_t)n;
        char *end = memmem(buf, got, "\r\n\r\n", 4);
        if (end != NULL) {
            *rest = end + 4, *rest_len = got - (size_t)(end + 4 - buf);
            return 0;
        }
    }
    return -1;
}

/* One connection, from its upstream connect (after its head, with --connect) to the end of
 * both ways. */
static void relay(int client, const struct sockaddr_in *upstream) {
    static const char established[] = "HTTP/1.1 200 Connection established\r\n\r\n";
    struct way up = {.pipe = {-1, -1}}, down = {.pipe = {-1, -1}}; /* client to far, far to client */
    char head[HEAD_BYTES];
    const char *rest = NULL;
    size_t rest_len = 0;
    int far = -1;
    nodelay(client);
    if (connect_mode && read_head(client, head, &rest, &rest_len) < 0) goto out;
    far = socket(AF_INET, SOCK_STREAM, 0);
    if (far < 0) goto out;
    nodelay(far);
    if (connect(far, (const struct sockaddr *)upstream, sizeof *upstream) < 0) goto out;
    if (connect_mode && (send_all(client, established, sizeof established - 1) < 0 ||
                         send_all(far, rest, rest_len) < 0))
        goto out;
    fcntl(client, F_SETFL, O_NONBLOCK), fcntl(far, F_SETFL, O_NONBLOCK);
    if (way_open(&up, client, far) < 0 || way_open(&down, far, client) < 0) goto out;
    while (!(up.done && down.done)) {
        struct pollfd fds[2] = {{client, 0, 0}, {far, 0, 0}};
        if (!up.eof && up.held < up.room) fds[0].events |= POLLIN;
        if (!down.eof && down.held < down.room) fds[1].events |= POLLIN;
        if (up.held > 0) fds[1].events |= POLLOUT;
        if (down.held > 0) fds[0].events |= POLLOUT;
        if (poll(fds, 2, -1) < 0) {
            if (errno == EINTR) continue;
            goto out;
        }
        if ((fds[0].revents | fds[1].revents) & (POLLERR | POLLNVAL)) goto out; /* a reset */
        if (way_step(&up, fds[0].revents) < 0 || way_step(&down, fds[1].revents) < 0) goto out;
    }
out:
    for (int i = 0; i < 2; i++) {
        if (up.pipe[i] >= 0) close(up.pipe[i]);
        if (down.pipe[i] >= 0) close(down.pipe[i]);
    }
    if (far >= 0) close(far);
    close(client);
}

int main(int argc, char **argv) {
    const char *self = argv[0];
    connect_mode = argc > 1 && strcmp(argv[1], "--connect") == 0;
    argc -= connect_mode, argv += connect_mode;
    if (argc != 4 && argc != 5) {
        fprintf(stderr, "usage: %s [--connect] LISTEN_PORT UPSTREAM_ADDR UPSTREAM_PORT [LISTEN_ADDR]\n", self);
        return 2;
    }
    struct sockaddr_in here = {.sin_family = AF_INET, .sin_port = htons((unsigned short)atoi(argv[1]))};
    struct sockaddr_in upstream = {.sin_family = AF_INET, .sin_port = htons((unsigned short)atoi(argv[3]))};
    here.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    if (argc == 5 && inet_pton(AF_INET, argv[4], &here.sin_addr) != 1) die("the listen address");
    if (inet_pton(AF_INET, argv[2], &upstream.sin_addr) != 1) die("the upstream address");
    signal(SIGPIPE, SIG_IGN); /* a write to a reset peer is an error, not the end */
    int one = 1, listener = socket(AF_INET, SOCK_STREAM, 0);
    if (listener < 0 || setsockopt(listener, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one) < 0) die("socket");
    if (bind(listener, (struct sockaddr *)&here, sizeof here) < 0 || listen(listener, 128) < 0) die("listen");
    socklen_t len = sizeof here;
    if (getsockname(listener, (struct sockaddr *)&here, &len) < 0) die("getsockname");
    pid_t first = getpid();
    for (int i = 0; i < WORKERS; i++) {
        pid_t pid = fork();
        if (pid < 0) die("fork");
        if (pid > 0) continue;
        prctl(PR_SET_PDEATHSIG, SIGKILL);
        if (getppid() != first) _exit(1); /* the first process died before the prctl */
        for (;;) {
            int client = accept(listener, NULL, NULL);
            if (client >= 0) relay(client, &upstream);
            else if (errno != EINTR && errno != ECONNABORTED) die("accept");
        }
    }
    printf("%d\n", ntohs(here.sin_port)); /* ready: every worker is listening */
    fflush(stdout);
    for (;;) pause(); /* until killed, with the workers */
}
