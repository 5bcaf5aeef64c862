/*
 * boxd-init: PID 1 of a boxd guest, in front of the Python agent (agent.py).
 *
 * It owns the host connection (the virtio-serial port "boxd.agent") and answers the
 * protocol's hot operations itself: hello, ping, identity, sync, exec without stdin
 * (the RL rollout path: fork, run a command, read its output) and exec with streamed
 * stdin (machines.spawn's processes: boxd.rl's step channel, one stdin message in and
 * one stdout message out per frame), with kill, stdin and attach for those execs.
 * Everything else (exec with one-shot stdin or on a pty, resize, files, stat) is relayed,
 * line by line, to the Python agent over a socketpair (agent.py --relay-fd 3), and the
 * agent's lines are relayed back.
 *
 * Why: a fork child is a new QEMU process, and under TCG it must translate every guest
 * code path it runs before running it. Answering hello + identity in CPython costs
 * ~7k translation blocks (~0.1 s) on each child's critical path, and a first exec
 * through subprocess.Popen ~12k more; here they cost a few hundred. With KVM the gain
 * is smaller but real (no interpreter on the fork path). A frame relayed through
 * agent.py (JSON, base64, a thread hand-off each way) cost ~3 ms of the step channel's
 * round trip under TCG; here it costs a few syscalls (docs/benchmarks.md, "rl").
 *
 * Protocol: docs/agent-protocol.md. Wire constants mirror src/boxd/guest/protocol.py
 * (tests/unit/test_agent.py runs the agent test-suite against both front ends).
 *
 * A gVisor sandbox runs it too (the engine's spec makes it PID 1 when the agent tree has
 * it): there the host connection is the sandbox's stdin and stdout (--stdio, two host
 * FIFOs the engine holds open read-write, so neither ever reports EOF: a reconnect is
 * only a hello with a new nonce), and the wall clock is the host's (--host-clock:
 * identity leaves it alone, as agent.py --host-clock does). Without it (no C compiler
 * when the agent tree was made) agent.py is PID 1 and serves the FIFOs itself.
 *
 * Usage (guest):  boxd-init
 * Usage (gVisor): boxd-init --stdio --host-clock --memory-mib N --agent /opt/boxd/agent.py
 *                           -- --host-clock   (--memory-mib: the guest's OOM killer)
 * Usage (tests):  boxd-init --connect SOCK [--sysroot DIR] [--python PY] [--agent PATH]
 *                           [--python-arg A]... (after PY, before -u AGENT)
 *                           [-- extra agent.py arguments]
 */
#define _GNU_SOURCE
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <grp.h> /* setgroups */
#include <netinet/in.h> /* --dial */
#include <linux/random.h> /* RNDADDENTROPY, RNDRESEEDCRNG */
#include <poll.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/prctl.h>
#include <sys/signalfd.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/sysmacros.h>
#include <sys/types.h>
#include <sys/un.h>
#include <sys/utsname.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#define PROTOCOL_MAJOR "1"
#define PROTOCOL_VERSION "1.9"
#define PORT_NAME "boxd.agent"
#define IDENTITY_DIR "run/boxd"
#define MAX_LINE (64L * 1024 * 1024)
#define RETRY_MS 20
#define WRITE_STALL_MS 30000
#define RESTART_MS 100
#define QUEUE_MAX (8L * 1024 * 1024) /* relayed bytes agent.py may lag behind */
#define INTERNAL_ID "{\"id\":-1,"

static const char *opt_connect;
static int opt_stdio;      /* the host is stdin (requests) and stdout (replies): gVisor */
static int opt_host_clock; /* identity's "now" is not applied: the clock is the host's */
static const char *opt_sysroot;
static const char *opt_python = "/usr/bin/python3";
/* --python-arg A (repeatable): arguments between opt_python and "-u AGENT", so agent.py
 * can run on a Python that is not the root's: a dynamic loader with --library-path and
 * the Python it loads (gVisor machines of a container image, docs/images.md). */
#define MAX_PYTHON_ARGS 16
static char *python_args[MAX_PYTHON_ARGS];
static int n_python_args;
static const char *opt_agent = "/run/boxd/agent.py";
/* --memory-mib N (gVisor): the machine's memory; past it, the largest guest process is
 * killed (memory_check), as a kernel's OOM killer would in a QEMU guest of N MiB. */
static long opt_memory_mib;
static char **agent_extra;
static int n_agent_extra;

static const char *default_cwd = "/home/boxd"; /* agent.py's --default-cwd, if given */

#define EXEC_CHUNK 65536
/* After a timeout's SIGTERM to the process group, SIGKILL this much later if the command
   has not exited (protocol.py's EXEC_KILL_GRACE). */
#define EXEC_KILL_GRACE_MS 2000
#define EXIT_DRAIN_IDLE_MS 250 /* after exit, stop reading pipes after this much quiet */
#define EXIT_DRAIN_MAX_MS 2000 /* ... or this long (background children hold them) */
static const char *const DEFAULT_ENV[] = {
    "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", "HOME=/root",
    "LANG=C.UTF-8", "TERM=xterm-256color", "USER=root", NULL};

struct buf {
    char *p;
    size_t start, len, cap; /* data is p[start .. start+len) */
};

struct exec {
    long long id;
    char nonce[256]; /* events go only to the connection that asked */
    pid_t pid;
    int fd[2];       /* stdout, stderr pipes (-1 once closed) */
    int exited, status, timed_out;
    double start;
    long long deadline, exited_at, last_data; /* monotonic ms; deadline 0 = none */
    long long kill_at; /* after a timeout's SIGTERM: when SIGKILL comes (0: not due) */
    long long window, sent, acked; /* 1.3 flow control: window 0 = none */
    /* stdin_stream execs (machines.spawn's processes, boxd.rl's env servers): */
    int stream;      /* stdin stays open for stdin requests */
    int in_fd;       /* the write end of its stdin pipe (-1: none, or closed) */
    int in_eof;      /* close in_fd once inq is written */
    struct buf inq;  /* stdin bytes the command has not taken yet */
    struct exec *next;
};
static struct exec *execs;

static int host_fd = -1;     /* virtio port, the test socket, or stdin (--stdio) */
static int host_out = -1;    /* where replies go: host_fd, or stdout (--stdio) */
static int host_present;     /* bytes arrived since the last hang-up */
static int broken_line;      /* a message to the host was cut: start the next on a new line */
static long long host_retry_at; /* monotonic ms: poll the host again after a hang-up */
static int py_fd = -1;       /* our end of the socketpair to agent.py */
static pid_t py_pid = -1;
static long long py_restart_at;
static char cur_nonce[256];  /* nonce of the current host connection */
static char py_nonce[256];   /* nonce agent.py last heard (it drops stale work on change) */
static unsigned long hangups;
static double started;

/* Ids of requests relayed to agent.py and not yet ended (by a result or error event):
   if agent.py dies they are failed at once instead of leaving the host waiting. */
static long long *inflight;
static size_t n_inflight, cap_inflight;

static void inflight_add(long long id) {
    for (size_t i = 0; i < n_inflight; i++)
        if (inflight[i] == id) return;
    if (n_inflight == cap_inflight) {
        cap_inflight = cap_inflight ? cap_inflight * 2 : 64;
        inflight = realloc(inflight, cap_inflight * sizeof *inflight);
        if (!inflight) abort();
    }
    inflight[n_inflight++] = id;
}

static void inflight_remove(long long id) {
    for (size_t i = 0; i < n_inflight; i++)
        if (inflight[i] == id) {
            inflight[i] = inflight[--n_inflight];
            return;
        }
}

static struct buf hbuf, pybuf, pyq;

static void logf_(const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    fprintf(stderr, "boxd-init[%d] ", (int)getpid());
    vfprintf(stderr, fmt, ap);
    fputc('\n', stderr);
    va_end(ap);
}

static long long now_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (long long)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

static double mono(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + ts.tv_nsec / 1e9;
}

static double wall(void) {
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return (double)ts.tv_sec + ts.tv_nsec / 1e9;
}

/* ------------------------------------------------------------------ buffers */

static void buf_reserve(struct buf *b, size_t extra) {
    if (b->start > 0 && b->start + b->len + extra > b->cap) {
        memmove(b->p, b->p + b->start, b->len);
        b->start = 0;
    }
    if (b->len + extra > b->cap) {
        size_t cap = b->cap ? b->cap : 65536;
        while (cap < b->len + extra) cap *= 2;
        char *p = realloc(b->p, cap);
        if (!p) {
            logf_("out of memory");
            abort();
        }
        b->p = p;
        b->cap = cap;
    }
}

static void buf_add(struct buf *b, const char *d, size_t n) {
    buf_reserve(b, n);
    memcpy(b->p + b->start + b->len, d, n);
    b->len += n;
}

static void buf_drop(struct buf *b, size_t n) {
    b->start += n;
    b->len -= n;
    if (b->len == 0) b->start = 0;
}

static void buf_clear(struct buf *b) { b->start = b->len = 0; }

/* ------------------------------------------------------------------ JSON (flat objects) */

enum jtype { J_STR, J_NUM, J_NULL, J_OTHER };
struct jfield {
    const char *key;
    size_t klen;
    enum jtype type;
    const char *val; /* strings: the raw text between the quotes; else the value text */
    size_t vlen;
};
#define MAX_FIELDS 32

static const char *ws(const char *p, const char *e) {
    while (p < e && (*p == ' ' || *p == '\t' || *p == '\r' || *p == '\n')) p++;
    return p;
}

/* p at '"': returns the pointer after the closing quote, or NULL. */
static const char *skip_string(const char *p, const char *e) {
    for (p++; p < e; p++) {
        if (*p == '\\') {
            p++;
        } else if (*p == '"') {
            return p + 1;
        }
    }
    return NULL;
}

static const char *skip_value(const char *p, const char *e) {
    if (p >= e) return NULL;
    if (*p == '"') return skip_string(p, e);
    if (*p == '{' || *p == '[') {
        int depth = 0;
        while (p < e) {
            if (*p == '"') {
                p = skip_string(p, e);
                if (!p) return NULL;
                continue;
            }
            if (*p == '{' || *p == '[') depth++;
            if (*p == '}' || *p == ']') {
                if (--depth == 0) return p + 1;
            }
            p++;
        }
        return NULL;
    }
    const char *s = p;
    while (p < e && *p != ',' && *p != '}' && *p != ']' && *p != ' ' && *p != '\t' &&
           *p != '\r' && *p != '\n')
        p++;
    return p > s ? p : NULL;
}

/* The top-level fields of one JSON object. Returns their number, or -1 if malformed. */
static int json_fields(const char *s, size_t n, struct jfield *f) {
    const char *p = ws(s, s + n), *e = s + n;
    int count = 0;
    if (p >= e || *p != '{') return -1;
    p = ws(p + 1, e);
    if (p < e && *p == '}') return ws(p + 1, e) == e ? 0 : -1;
    for (;;) {
        if (p >= e || *p != '"') return -1;
        const char *k = p + 1, *kend = skip_string(p, e);
        if (!kend) return -1;
        p = ws(kend, e);
        if (p >= e || *p != ':') return -1;
        p = ws(p + 1, e);
        const char *v = p, *vend = skip_value(p, e);
        if (!vend) return -1;
        if (count < MAX_FIELDS) {
            struct jfield *x = &f[count++];
            x->key = k;
            x->klen = (size_t)(kend - 1 - k);
            if (*v == '"') {
                x->type = J_STR;
                x->val = v + 1;
                x->vlen = (size_t)(vend - 1 - (v + 1));
            } else {
                x->val = v;
                x->vlen = (size_t)(vend - v);
                if (x->vlen == 4 && !memcmp(v, "null", 4))
                    x->type = J_NULL;
                else if (*v == '-' || (*v >= '0' && *v <= '9'))
                    x->type = J_NUM;
                else
                    x->type = J_OTHER;
            }
        }
        p = ws(vend, e);
        if (p < e && *p == ',') {
            p = ws(p + 1, e);
            continue;
        }
        if (p < e && *p == '}') return ws(p + 1, e) == e ? count : -1;
        return -1;
    }
}

static const struct jfield *field(const struct jfield *f, int n, const char *key) {
    size_t kl = strlen(key);
    for (int i = 0; i < n; i++)
        if (f[i].klen == kl && !memcmp(f[i].key, key, kl)) return &f[i];
    return NULL;
}

static int hexval(char c) {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    return -1;
}

static size_t put_utf8(char *o, unsigned cp) {
    if (cp < 0x80) {
        o[0] = (char)cp;
        return 1;
    }
    if (cp < 0x800) {
        o[0] = (char)(0xc0 | (cp >> 6));
        o[1] = (char)(0x80 | (cp & 0x3f));
        return 2;
    }
    if (cp < 0x10000) {
        o[0] = (char)(0xe0 | (cp >> 12));
        o[1] = (char)(0x80 | ((cp >> 6) & 0x3f));
        o[2] = (char)(0x80 | (cp & 0x3f));
        return 3;
    }
    o[0] = (char)(0xf0 | (cp >> 18));
    o[1] = (char)(0x80 | ((cp >> 12) & 0x3f));
    o[2] = (char)(0x80 | ((cp >> 6) & 0x3f));
    o[3] = (char)(0x80 | (cp & 0x3f));
    return 4;
}

/* Unescape a J_STR field into out (NUL-terminated). Returns its length, or -1. */
static long json_str(const struct jfield *x, char *out, size_t cap) {
    size_t o = 0;
    const char *p = x->val, *e = x->val + x->vlen;
    while (p < e) {
        if (o + 5 > cap) return -1;
        char c = *p++;
        if (c != '\\') {
            out[o++] = c;
            continue;
        }
        if (p >= e) return -1;
        c = *p++;
        switch (c) {
        case '"': case '\\': case '/': out[o++] = c; break;
        case 'b': out[o++] = '\b'; break;
        case 'f': out[o++] = '\f'; break;
        case 'n': out[o++] = '\n'; break;
        case 'r': out[o++] = '\r'; break;
        case 't': out[o++] = '\t'; break;
        case 'u': {
            unsigned cp = 0;
            for (int i = 0; i < 4; i++) {
                int h = p < e ? hexval(*p++) : -1;
                if (h < 0) return -1;
                cp = cp << 4 | (unsigned)h;
            }
            if (cp >= 0xd800 && cp < 0xdc00 && e - p >= 6 && p[0] == '\\' && p[1] == 'u') {
                unsigned lo = 0;
                for (int i = 2; i < 6; i++) {
                    int h = hexval(p[i]);
                    if (h < 0) return -1;
                    lo = lo << 4 | (unsigned)h;
                }
                if (lo >= 0xdc00 && lo < 0xe000) {
                    cp = 0x10000 + ((cp - 0xd800) << 10) + (lo - 0xdc00);
                    p += 6;
                }
            }
            o += put_utf8(out + o, cp);
            break;
        }
        default: return -1;
        }
    }
    out[o] = 0;
    return (long)o;
}

/* Append s as a JSON string literal. */
static void put_jstr(struct buf *b, const char *s) {
    buf_add(b, "\"", 1);
    for (; *s; s++) {
        unsigned char c = (unsigned char)*s;
        char esc[8];
        if (c == '"' || c == '\\') {
            esc[0] = '\\';
            esc[1] = (char)c;
            buf_add(b, esc, 2);
        } else if (c < 0x20) {
            snprintf(esc, sizeof esc, "\\u%04x", c);
            buf_add(b, esc, 6);
        } else {
            buf_add(b, (const char *)&c, 1);
        }
    }
    buf_add(b, "\"", 1);
}

static void put(struct buf *b, const char *fmt, ...) {
    char tmp[512];
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(tmp, sizeof tmp, fmt, ap);
    va_end(ap);
    if (n > 0) buf_add(b, tmp, (size_t)n < sizeof tmp ? (size_t)n : sizeof tmp - 1);
}

static int is_int(const struct jfield *x, long long *out) {
    if (!x || x->type != J_NUM || x->vlen >= 32) return 0;
    char tmp[32], *end;
    memcpy(tmp, x->val, x->vlen);
    tmp[x->vlen] = 0;
    if (strpbrk(tmp, ".eE")) return 0;
    errno = 0;
    *out = strtoll(tmp, &end, 10);
    return errno == 0 && *end == 0;
}

static int num(const struct jfield *x, double *out) {
    if (!x || x->type != J_NUM || x->vlen >= 64) return 0;
    char tmp[64], *end;
    memcpy(tmp, x->val, x->vlen);
    tmp[x->vlen] = 0;
    *out = strtod(tmp, &end);
    return *end == 0;
}

static long b64decode(const char *s, size_t n, unsigned char *out, size_t cap) {
    unsigned acc = 0;
    int bits = 0;
    size_t o = 0;
    for (size_t i = 0; i < n; i++) {
        char c = s[i];
        int v;
        if (c >= 'A' && c <= 'Z') v = c - 'A';
        else if (c >= 'a' && c <= 'z') v = c - 'a' + 26;
        else if (c >= '0' && c <= '9') v = c - '0' + 52;
        else if (c == '+') v = 62;
        else if (c == '/') v = 63;
        else if (c == '=') break;
        else continue; /* like Python's b64decode(validate=False): skip the rest */
        acc = acc << 6 | (unsigned)v;
        bits += 6;
        if (bits >= 8) {
            bits -= 8;
            if (o >= cap) return -1;
            out[o++] = (unsigned char)(acc >> bits);
        }
    }
    return (long)o;
}

static void put_b64(struct buf *b, const unsigned char *d, size_t n) {
    static const char tab[] =
        "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    buf_reserve(b, (n + 2) / 3 * 4);
    char *o = b->p + b->start + b->len;
    size_t i = 0;
    for (; i + 2 < n; i += 3) {
        unsigned v = (unsigned)d[i] << 16 | (unsigned)d[i + 1] << 8 | d[i + 2];
        *o++ = tab[v >> 18];
        *o++ = tab[(v >> 12) & 63];
        *o++ = tab[(v >> 6) & 63];
        *o++ = tab[v & 63];
    }
    if (i < n) {
        unsigned v = (unsigned)d[i] << 16 | (i + 1 < n ? (unsigned)d[i + 1] << 8 : 0);
        *o++ = tab[v >> 18];
        *o++ = tab[(v >> 12) & 63];
        *o++ = i + 1 < n ? tab[(v >> 6) & 63] : '=';
        *o++ = '=';
    }
    b->len = (size_t)(o - (b->p + b->start));
}

/* The string elements of a JSON array (NULL-terminated, malloc'ed), or NULL. */
static char **json_strings(const char *s, size_t n, int *count) {
    const char *p = ws(s, s + n), *e = s + n;
    size_t cap = 8, k = 0;
    char **out = calloc(cap, sizeof *out);
    if (!out || p >= e || *p != '[') goto bad;
    p = ws(p + 1, e);
    if (p < e && *p == ']') goto bad; /* an empty argv is not a command */
    for (;;) {
        if (p >= e || *p != '"') goto bad;
        const char *end = skip_string(p, e);
        if (!end) goto bad;
        struct jfield x = {.type = J_STR, .val = p + 1, .vlen = (size_t)(end - 1 - (p + 1))};
        char *str = malloc(x.vlen * 4 + 8);
        long sl = str ? json_str(&x, str, x.vlen * 4 + 8) : -1;
        if (sl < 0 || (size_t)sl != strlen(str)) {
            free(str);
            goto bad;
        }
        if (k + 2 > cap) {
            cap *= 2;
            char **grown = realloc(out, cap * sizeof *out);
            if (!grown) goto bad;
            out = grown;
        }
        out[k++] = str;
        out[k] = NULL;
        p = ws(end, e);
        if (p < e && *p == ',') {
            p = ws(p + 1, e);
            continue;
        }
        if (p < e && *p == ']') break;
        goto bad;
    }
    *count = (int)k;
    return out;
bad:
    if (out)
        for (size_t i = 0; i < k; i++) free(out[i]);
    free(out);
    return NULL;
}

static void free_strings(char **v) {
    if (!v) return;
    for (char **p = v; *p; p++) free(*p);
    free(v);
}

/* ------------------------------------------------------------------ host side */

static void host_close(void) {
    if (host_fd >= 0) close(host_fd);
    host_fd = host_out = -1;
}

static int find_port(char *dev, size_t cap) {
    DIR *d = opendir("/sys/class/virtio-ports");
    if (!d) return -1;
    struct dirent *ent;
    int found = -1;
    while ((ent = readdir(d))) {
        if (ent->d_name[0] == '.') continue;
        char path[512], name[128] = "";
        snprintf(path, sizeof path, "/sys/class/virtio-ports/%s/name", ent->d_name);
        FILE *f = fopen(path, "re");
        if (!f) continue;
        if (!fgets(name, sizeof name, f)) name[0] = 0;
        fclose(f);
        name[strcspn(name, "\n")] = 0;
        if (strcmp(name, PORT_NAME)) continue;
        snprintf(dev, cap, "/dev/%s", ent->d_name);
        if (access(dev, F_OK) != 0) {
            /* No devtmpfs entry: make the node from sysfs' major:minor. */
            unsigned maj, min;
            snprintf(path, sizeof path, "/sys/class/virtio-ports/%s/dev", ent->d_name);
            f = fopen(path, "re");
            if (f && fscanf(f, "%u:%u", &maj, &min) == 2)
                mknod(dev, S_IFCHR | 0600, makedev(maj, min));
            if (f) fclose(f);
        }
        found = 0;
        break;
    }
    closedir(d);
    return found;
}

static void host_open(void) {
    static int warned;
    if (opt_stdio) {
        /* Never closed or reopened: the FIFOs outlive every host connection. */
        fcntl(0, F_SETFL, fcntl(0, F_GETFL) | O_NONBLOCK);
        fcntl(1, F_SETFL, fcntl(1, F_GETFL) | O_NONBLOCK);
        host_fd = 0;
        host_out = 1;
        logf_("serving on stdin/stdout");
        return;
    }
    if (opt_connect) {
        int s = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
        struct sockaddr_un a = {.sun_family = AF_UNIX};
        snprintf(a.sun_path, sizeof a.sun_path, "%s", opt_connect);
        if (s >= 0 && connect(s, (struct sockaddr *)&a, sizeof a) == 0) {
            host_fd = host_out = s;
            broken_line = 0;
            return;
        }
        if (s >= 0) close(s);
        host_retry_at = now_ms() + RETRY_MS;
        return;
    }
    char dev[300];
    if (find_port(dev, sizeof dev) != 0) {
        if (!warned++) logf_("virtio port %s not found yet; retrying", PORT_NAME);
        host_retry_at = now_ms() + 100;
        return;
    }
    host_fd = host_out = open(dev, O_RDWR | O_NONBLOCK | O_CLOEXEC);
    if (host_fd < 0) {
        logf_("cannot open %s: %s", dev, strerror(errno));
        host_retry_at = now_ms() + 500;
        return;
    }
    logf_("serving on %s", dev);
}

/* Send one whole message to the host, or drop it (host away, or not reading for 30 s). */
static void host_send(const char *data, size_t n) {
    if (host_out < 0) return;
    if (broken_line) {
        if (write(host_out, "\n", 1) != 1) return;
        broken_line = 0;
    }
    size_t done = 0;
    long long stalled = 0;
    while (done < n) {
        ssize_t w = write(host_out, data + done, n - done);
        if (w > 0) {
            done += (size_t)w;
            stalled = 0;
            continue;
        }
        if (w < 0 && errno != EAGAIN && errno != EINTR) {
            if (errno != EPIPE && errno != ECONNRESET && errno != ENOTCONN)
                logf_("channel write error: %s", strerror(errno));
            broken_line = done > 0;
            return;
        }
        long long t = now_ms();
        if (!stalled) stalled = t;
        if (t - stalled > WRITE_STALL_MS) {
            logf_("host stopped reading; dropping a message");
            broken_line = 1;
            return;
        }
        struct pollfd p = {host_out, POLLOUT, 0};
        if (poll(&p, 1, 100) > 0 && (p.revents & (POLLHUP | POLLERR | POLLNVAL)) &&
            !(p.revents & POLLOUT)) {
            broken_line = done > 0;
            return;
        }
    }
}

static void reply_start(struct buf *b, long long id, const char *ev) {
    buf_clear(b);
    put(b, "{\"id\":%lld,\"ev\":\"%s\"", id, ev);
}

static void reply_end(struct buf *b) {
    buf_add(b, "}\n", 2);
    host_send(b->p + b->start, b->len);
}

static void fail(long long id, const char *code, const char *msg) {
    static struct buf b;
    reply_start(&b, id, "error");
    put(&b, ",\"code\":\"%s\",\"message\":", code);
    put_jstr(&b, msg);
    reply_end(&b);
}

static const char *errno_name(int e) {
    switch (e) {
    case EPERM: return "EPERM";
    case ENOENT: return "ENOENT";
    case EACCES: return "EACCES";
    case EEXIST: return "EEXIST";
    case ENOTDIR: return "ENOTDIR";
    case EISDIR: return "EISDIR";
    case EINVAL: return "EINVAL";
    case ENOSPC: return "ENOSPC";
    case EROFS: return "EROFS";
    case EBUSY: return "EBUSY";
    default: return "EIO";
    }
}

static void fail_errno(long long id, const char *what) {
    char msg[512];
    int e = errno;
    snprintf(msg, sizeof msg, "%s: %s", strerror(e), what);
    fail(id, errno_name(e), msg);
}

/* ------------------------------------------------------------------ the Python agent */

static void py_send(const char *d, size_t n) {
    if (py_fd >= 0) buf_add(&pyq, d, n);
}

static void py_flush(void) {
    while (py_fd >= 0 && pyq.len) {
        ssize_t w = write(py_fd, pyq.p + pyq.start, pyq.len);
        if (w > 0) {
            buf_drop(&pyq, (size_t)w);
            continue;
        }
        if (w < 0 && errno == EINTR) continue;
        return; /* EAGAIN (poll for POLLOUT) or a dead agent (SIGCHLD follows) */
    }
}

/* Tell agent.py about the current connection: it drops work of older ones. */
static void py_sync_nonce(void) {
    if (!strcmp(py_nonce, cur_nonce)) return;
    static struct buf b;
    buf_clear(&b);
    put(&b, "%s\"op\":\"hello\",\"version\":\"%s\",\"nonce\":", INTERNAL_ID,
        PROTOCOL_VERSION);
    put_jstr(&b, cur_nonce);
    buf_add(&b, "}\n", 2);
    py_send(b.p + b.start, b.len);
    snprintf(py_nonce, sizeof py_nonce, "%s", cur_nonce);
}

static void py_spawn(void) {
    int sv[2];
    if (socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv) != 0) {
        logf_("socketpair: %s", strerror(errno));
        py_restart_at = now_ms() + 1000;
        return;
    }
    pid_t pid = fork();
    if (pid < 0) {
        logf_("fork: %s", strerror(errno));
        close(sv[0]);
        close(sv[1]);
        py_restart_at = now_ms() + 1000;
        return;
    }
    if (pid == 0) {
        sigset_t all;
        sigemptyset(&all);
        sigprocmask(SIG_SETMASK, &all, NULL);
        if (sv[1] == 3) {
            fcntl(3, F_SETFD, 0);
        } else {
            dup2(sv[1], 3);
        }
        if (opt_stdio) { /* the host's FIFOs are ours alone: agent.py talks over fd 3 */
            int null = open("/dev/null", O_RDWR);
            if (null >= 0) {
                dup2(null, 0);
                dup2(null, 1);
                if (null > 3) close(null);
            }
        }
        char **argv = calloc((size_t)n_agent_extra + (size_t)n_python_args + 8, sizeof *argv);
        int a = 0;
        argv[a++] = (char *)opt_python;
        for (int i = 0; i < n_python_args; i++) argv[a++] = python_args[i];
        argv[a++] = "-u";
        argv[a++] = (char *)opt_agent;
        argv[a++] = "--relay-fd";
        argv[a++] = "3";
        for (int i = 0; i < n_agent_extra; i++) argv[a++] = agent_extra[i];
        argv[a] = NULL;
        execv(opt_python, argv);
        fprintf(stderr, "boxd-init: cannot run %s: %s\n", opt_python, strerror(errno));
        _exit(127);
    }
    close(sv[1]);
    fcntl(sv[0], F_SETFL, O_NONBLOCK);
    py_fd = sv[0];
    py_pid = pid;
    buf_clear(&pybuf);
    buf_clear(&pyq);
    /* Never equal to a real nonce: the first relayed request is preceded by a hello. */
    snprintf(py_nonce, sizeof py_nonce, "\x01");
}

static void py_gone(void) {
    for (size_t i = 0; i < n_inflight; i++)
        fail(inflight[i], "EINTERNAL", "the guest agent restarted; this request was lost");
    n_inflight = 0;
    if (py_fd >= 0) close(py_fd);
    py_fd = -1;
    py_pid = -1;
    buf_clear(&pybuf);
    buf_clear(&pyq);
    py_restart_at = now_ms() + RESTART_MS;
}

/* Lines from agent.py go to the host as they are (except replies to our own hellos). */
static void py_readable(void) {
    for (;;) {
        buf_reserve(&pybuf, 1 << 20);
        ssize_t r = read(py_fd, pybuf.p + pybuf.start + pybuf.len, 1 << 20);
        if (r < 0 && errno == EINTR) continue;
        if (r <= 0) break;
        pybuf.len += (size_t)r;
        if (r < (1 << 20)) break;
    }
    for (;;) {
        char *s = pybuf.p + pybuf.start;
        char *nl = memchr(s, '\n', pybuf.len);
        if (!nl) break;
        size_t n = (size_t)(nl - s) + 1;
        if (strncmp(s, INTERNAL_ID, strlen(INTERNAL_ID)) != 0) {
            /* agent.py writes {"id":N,"ev":"E",...}: a result or error ends request N */
            char *end;
            if (n > 6 && !strncmp(s, "{\"id\":", 6)) {
                long long id = strtoll(s + 6, &end, 10);
                if (end > s + 6 && (!strncmp(end, ",\"ev\":\"result\"", 15) ||
                                    !strncmp(end, ",\"ev\":\"error\"", 14)))
                    inflight_remove(id);
            }
            host_send(s, n);
        }
        buf_drop(&pybuf, n);
    }
}

/* ------------------------------------------------------------------ operations */

static void op_hello(long long id, const struct jfield *f, int n) {
    static struct buf b;
    const struct jfield *v = field(f, n, "version"), *nonce = field(f, n, "nonce");
    char version[64] = "", nbuf[256] = "";
    if (v && v->type == J_STR && json_str(v, version, sizeof version) < 0) version[0] = 0;
    int have_nonce = nonce && nonce->type == J_STR && json_str(nonce, nbuf, sizeof nbuf) >= 0;
    if (have_nonce && strcmp(nbuf, cur_nonce)) {
        snprintf(cur_nonce, sizeof cur_nonce, "%s", nbuf);
        n_inflight = 0; /* the old connection's requests are no one's now */
    }
    size_t ml = strcspn(version, ".");
    if (ml != strlen(PROTOCOL_MAJOR) || strncmp(version, PROTOCOL_MAJOR, ml)) {
        char msg[200];
        snprintf(msg, sizeof msg, "host speaks agent protocol %s, this agent speaks %s",
                 version[0] ? version : "?", PROTOCOL_VERSION);
        reply_start(&b, id, "error");
        put(&b, ",\"code\":\"EVERSION\",\"message\":");
        put_jstr(&b, msg);
        put(&b, ",\"version\":\"%s\"", PROTOCOL_VERSION);
        reply_end(&b);
        return;
    }
    struct utsname u;
    uname(&u);
    reply_start(&b, id, "result");
    put(&b, ",\"version\":\"%s\",\"nonce\":", PROTOCOL_VERSION);
    if (have_nonce)
        put_jstr(&b, nbuf);
    else
        put(&b, "null");
    put(&b, ",\"started\":%.6f,\"pid\":%d,\"hostname\":", started, (int)getpid());
    put_jstr(&b, u.nodename);
    put(&b, ",\"time\":%.6f", wall());
    reply_end(&b);
}

static void op_ping(long long id) {
    static struct buf b;
    reply_start(&b, id, "result");
    put(&b, ",\"time\":%.6f", wall());
    reply_end(&b);
}

static void op_sync(long long id) {
    static struct buf b;
    sync();
    reply_start(&b, id, "result");
    reply_end(&b);
}

/* Set IDENTITY_DIR/name, which /etc/name links to (or /etc/name itself, if a file).
 *
 * The tmpfs file is rewritten in place (pwrite + ftruncate on the same inode), not
 * replaced by a rename: a fork child pays to translate every kernel path it runs, and
 * create + rename + evicting the old inode cost ~2k translation blocks more. A reader
 * racing the write of these few bytes could see a mix of old and new; nothing in the
 * child reads them before identity returns but processes inherited from the source. A
 * regular /etc file (an image from before protocol 1.1, on ext4) is replaced atomically
 * (temp file + rename). */
static int write_identity(const char *name, const char *text, mode_t mode, char *what,
                          size_t wcap) {
    const char *root = opt_sysroot ? opt_sysroot : "";
    char etc[512], path[512], tmp[600];
    struct stat st;
    size_t len = strlen(text);
    snprintf(etc, sizeof etc, "%s/etc/%s", root, name);
    int linked = lstat(etc, &st) == 0 && S_ISLNK(st.st_mode);
    if (linked) {
        snprintf(path, sizeof path, "%s/%s/%s", root, IDENTITY_DIR, name);
        snprintf(what, wcap, "%s", path);
        int fd = open(path, O_WRONLY | O_CREAT | O_CLOEXEC, mode);
        if (fd < 0 && errno != EACCES) return -1;
        if (fd < 0) goto replace; /* 0444 and not root: replace it instead */
        int ok = pwrite(fd, text, len, 0) == (ssize_t)len && ftruncate(fd, (off_t)len) == 0 &&
                 fstat(fd, &st) == 0 && ((st.st_mode & 07777) == mode || fchmod(fd, mode) == 0);
        int e = errno;
        close(fd);
        errno = ok ? 0 : (e ? e : EIO);
        return ok ? 0 : -1;
    }
    snprintf(path, sizeof path, "%s", etc);
replace:
    snprintf(tmp, sizeof tmp, "%s.boxd-tmp", path);
    snprintf(what, wcap, "%s", tmp);
    int fd = open(tmp, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, mode);
    if (fd < 0) return -1;
    if (write(fd, text, len) != (ssize_t)len || fchmod(fd, mode) != 0) {
        int e = errno;
        close(fd);
        errno = e ? e : EIO;
        return -1;
    }
    close(fd);
    snprintf(what, wcap, "%s", path);
    return rename(tmp, path);
}

static int urandom_fd = -1; /* opened once: no open/close on a fork child's first run */

/* Mix the host's seed into the input pool, then force the CRNG to reseed from it: once the
 * CRNG is ready, adding entropy (RNDADDENTROPY or a write) does not reseed it, so two forks
 * of one moment would read the same /dev/urandom bytes until its next scheduled reseed (up
 * to 60 s of guest time) without RNDRESEEDCRNG (Linux >= 4.17, CAP_SYS_ADMIN). */
static void reseed(const unsigned char *seed, size_t n) {
    if (urandom_fd < 0) urandom_fd = open("/dev/urandom", O_WRONLY | O_CLOEXEC);
    int fd = urandom_fd;
    if (fd < 0) {
        logf_("cannot open /dev/urandom: %s", strerror(errno));
        return;
    }
    int added = 0;
    if (geteuid() == 0) {
        /* struct rand_pool_info { int entropy_count; int buf_size; __u32 buf[]; } */
        int req[2 + 64];
        memset(req, 0, sizeof req);
        req[0] = (int)(n * 8);
        req[1] = (int)n;
        memcpy(&req[2], seed, n);
        added = ioctl(fd, RNDADDENTROPY, req) == 0;
        /* ENOTTY: gVisor (its /dev/urandom draws from the host's on every read) */
        if (!added && errno != ENOTTY)
            logf_("RNDADDENTROPY failed (%s); mixing without credit", strerror(errno));
    }
    if (!added && write(fd, seed, n) < 0) logf_("writing /dev/urandom: %s", strerror(errno));
    /* gVisor has no CRNG to reseed (every read draws from the host): ENOTTY is fine */
    if (ioctl(fd, RNDRESEEDCRNG) != 0 && errno != ENOTTY && errno != EINVAL)
        logf_("RNDRESEEDCRNG failed: %s", strerror(errno));
}

/* The machine's in-guest API credential (1.5): IDENTITY_DIR/key, 0600, rewritten in place
 * like the identity files (keys have one length, so a racing reader sees old or new). */
static int write_api_key(const char *key, char *what, size_t wcap) {
    const char *root = opt_sysroot ? opt_sysroot : "";
    snprintf(what, wcap, "%s/%s/key", root, IDENTITY_DIR);
    int fd = open(what, O_WRONLY | O_CREAT | O_CLOEXEC, 0600);
    if (fd < 0) return -1;
    size_t len = strlen(key);
    struct stat st;
    int ok = pwrite(fd, key, len, 0) == (ssize_t)len && ftruncate(fd, (off_t)len) == 0 &&
             fstat(fd, &st) == 0 && ((st.st_mode & 07777) == 0600 || fchmod(fd, 0600) == 0);
    int e = errno;
    close(fd);
    errno = ok ? 0 : (e ? e : EIO);
    return ok ? 0 : -1;
}

static void op_identity(long long id, const struct jfield *f, int n) {
    static struct buf b;
    const struct jfield *h = field(f, n, "hostname"), *m = field(f, n, "machine_id");
    const struct jfield *s = field(f, n, "seed"), *t = field(f, n, "now");
    const struct jfield *k = field(f, n, "api_key");
    char host[256], mid[64], what[600], key[264];
    int have_key = k && k->type != J_NULL;
    if (have_key) {
        long kl = k->type == J_STR ? json_str(k, key, sizeof key - 2) : -1;
        int ok = kl > 0 && kl <= 256;
        for (long i = 0; ok && i < kl; i++) ok = key[i] > ' ' && key[i] < 0x7f;
        if (!ok) {
            fail(id, "EINVAL", "api_key must be a short printable string");
            return;
        }
        key[kl] = '\n';
        key[kl + 1] = 0;
    }
    unsigned char seed[256];
    long seed_len = 0;
    double now = 0;
    int have_host = h && h->type != J_NULL, have_mid = m && m->type != J_NULL;
    int have_now = t && t->type != J_NULL;
    if (have_host) {
        long hl = h->type == J_STR ? json_str(h, host, sizeof host) : -1;
        if (hl <= 0 || hl > 64 || strchr(host, '/')) {
            fail(id, "EINVAL", "bad hostname");
            return;
        }
    }
    if (have_mid) {
        long ml = m->type == J_STR ? json_str(m, mid, sizeof mid) : -1;
        int ok = ml == 32;
        for (int i = 0; ok && i < 32; i++)
            ok = (mid[i] >= '0' && mid[i] <= '9') || (mid[i] >= 'a' && mid[i] <= 'f');
        if (!ok) {
            fail(id, "EINVAL", "machine_id must be 32 lowercase hex digits");
            return;
        }
    }
    if (have_now && !num(t, &now)) {
        fail(id, "EINVAL", "now must be a number (seconds since the epoch)");
        return;
    }
    if (s && s->type == J_STR) {
        seed_len = b64decode(s->val, s->vlen, seed, sizeof seed);
        if (seed_len < 0) {
            fail(id, "EINVAL", "seed must be at most 256 bytes");
            return;
        }
    }
    char applied[128] = "";
    if (have_now && !opt_host_clock) {
        if (!opt_sysroot) {
            struct timespec ts = {(time_t)now, (long)((now - (double)(time_t)now) * 1e9)};
            if (clock_settime(CLOCK_REALTIME, &ts) != 0) {
                fail_errno(id, "clock_settime");
                return;
            }
        }
        strcat(applied, "\"clock\"");
    }
    if (seed_len > 0) {
        if (!opt_sysroot) reseed(seed, (size_t)seed_len);
        strcat(applied, applied[0] ? ",\"rng\"" : "\"rng\"");
    }
    if (have_host) {
        if (!opt_sysroot && sethostname(host, strlen(host)) != 0) {
            fail_errno(id, "sethostname");
            return;
        }
        size_t hl = strlen(host);
        host[hl] = '\n';
        host[hl + 1] = 0;
        if (write_identity("hostname", host, 0644, what, sizeof what) != 0) {
            fail_errno(id, what);
            return;
        }
        strcat(applied, applied[0] ? ",\"hostname\"" : "\"hostname\"");
    }
    if (have_mid) {
        mid[32] = '\n';
        mid[33] = 0;
        if (write_identity("machine-id", mid, 0444, what, sizeof what) != 0) {
            fail_errno(id, what);
            return;
        }
        strcat(applied, applied[0] ? ",\"machine_id\"" : "\"machine_id\"");
    }
    if (have_key) {
        if (write_api_key(key, what, sizeof what) != 0) {
            fail_errno(id, what);
            return;
        }
        strcat(applied, applied[0] ? ",\"api_key\"" : "\"api_key\"");
    }
    reply_start(&b, id, "result");
    put(&b, ",\"applied\":[%s]", applied);
    reply_end(&b);
}

/* ------------------------------------------------------------------ exec */

static void exec_event(struct exec *x, const char *ev, const unsigned char *d, size_t n) {
    static struct buf b;
    if (strcmp(x->nonce, cur_nonce)) return; /* its connection is gone: drop */
    x->sent += (long long)n;
    reply_start(&b, x->id, ev);
    buf_add(&b, ",\"data\":\"", 9);
    put_b64(&b, d, n);
    buf_add(&b, "\"", 1);
    reply_end(&b);
}

static void exec_feed(struct exec *x);

static struct exec *find_exec(long long id) {
    for (struct exec *x = execs; x; x = x->next)
        if (x->id == id) return x;
    return NULL;
}

/* Build the command's environment: DEFAULT_ENV with the request's env merged over it
   ("K": null unsets K). Returns a malloc'ed NULL-terminated array, or NULL. */
static char **exec_env(const struct jfield *env) {
    struct jfield f[MAX_FIELDS];
    int nf = 0;
    if (env && env->type == J_OTHER) {
        nf = json_fields(env->val, env->vlen, f);
        if (nf < 0) return NULL;
        if (nf == MAX_FIELDS) return NULL; /* maybe more: let agent.py do it */
    } else if (env && env->type != J_NULL) {
        return NULL;
    }
    size_t n = 0;
    char **out = calloc(sizeof DEFAULT_ENV / sizeof *DEFAULT_ENV + (size_t)nf + 1, sizeof *out);
    if (!out) return NULL;
    for (const char *const *d = DEFAULT_ENV; *d; d++) out[n++] = strdup(*d);
    for (int i = 0; i < nf; i++) {
        char key[256];
        if (f[i].klen == 0 || f[i].klen >= sizeof key) goto bad;
        memcpy(key, f[i].key, f[i].klen);
        key[f[i].klen] = 0;
        if (strchr(key, '\\') || strchr(key, '=')) goto bad;
        size_t kl = strlen(key);
        for (size_t j = 0; j < n; j++) /* drop an existing K= */
            if (!strncmp(out[j], key, kl) && out[j][kl] == '=') {
                free(out[j]);
                out[j] = out[--n];
                out[n] = NULL;
                break;
            }
        if (f[i].type == J_NULL) continue;
        if (f[i].type != J_STR) goto bad; /* numbers, booleans: agent.py's str() rules */
        char *val = malloc(f[i].vlen * 4 + 8);
        long vl = val ? json_str(&f[i], val, f[i].vlen * 4 + 8) : -1;
        if (vl < 0 || (size_t)vl != strlen(val)) { /* \u0000: agent.py reports it */
            free(val);
            goto bad;
        }
        char *kv = malloc(kl + strlen(val) + 2);
        if (!kv) {
            free(val);
            goto bad;
        }
        sprintf(kv, "%s=%s", key, val);
        free(val);
        out[n++] = kv;
        out[n] = NULL;
    }
    return out;
bad:
    free_strings(out);
    return NULL;
}

static void mkdirs(const char *path) {
    char tmp[1024];
    snprintf(tmp, sizeof tmp, "%s", path);
    for (char *p = tmp + 1; *p; p++)
        if (*p == '/') {
            *p = 0;
            mkdir(tmp, 0755);
            *p = '/';
        }
    mkdir(tmp, 0755);
}

/* Run an exec request without stdin, or with stdin_stream (then its stdin is a pipe fed
   by stdin requests, starting with the request's own "stdin" bytes if any). Returns 0 if
   handled, -1 to relay it instead. */
/* An exec's `user` (1.6) when this front end can run it itself: a name, or a uid, that
   the guest's /etc/passwd has, with no GROUP part. Its groups are the entry's group and
   every /etc/group line naming it, as agent.py's lookup_user (os.getgrouplist) makes
   them. Anything else (a GROUP part, a name or uid the file lacks, too many groups) is
   agent.py's, which answers the exact error or the numeric form. */
#define RUN_AS_GROUPS 64
struct run_as {
    uid_t uid;
    gid_t gid;
    int ngroups;
    gid_t groups[RUN_AS_GROUPS];
    char name[64], home[512];
};

/* Split a colon-separated line in place into `want` fields; 0 if it has fewer. */
static int colon_fields(char *line, char **out, int want) {
    line[strcspn(line, "\n")] = 0;
    for (int k = 0; k < want; k++) {
        out[k] = line;
        char *c = strchr(line, ':');
        if (!c) return k == want - 1;
        *c = 0;
        line = c + 1;
    }
    return 1;
}

static int lookup_run_as(const char *raw, struct run_as *ra) {
    size_t len = strlen(raw);
    if (!len || len >= sizeof ra->name || strchr(raw, ':')) return 0;
    int numeric = raw[strspn(raw, "0123456789")] == 0;
    FILE *pw = fopen("/etc/passwd", "re");
    if (!pw) return 0;
    char line[2048], *fld[7];
    int found = 0;
    while (!found && fgets(line, sizeof line, pw)) {
        if (!colon_fields(line, fld, 7)) continue;
        if (numeric ? strcmp(fld[2], raw) != 0 : strcmp(fld[0], raw) != 0) continue;
        if (strlen(fld[0]) >= sizeof ra->name || strlen(fld[5]) >= sizeof ra->home) break;
        ra->uid = (uid_t)strtoul(fld[2], NULL, 10);
        ra->gid = (gid_t)strtoul(fld[3], NULL, 10);
        snprintf(ra->name, sizeof ra->name, "%s", fld[0]);
        snprintf(ra->home, sizeof ra->home, "%s", *fld[5] ? fld[5] : "/");
        found = 1;
    }
    fclose(pw);
    if (!found) return 0;
    ra->ngroups = 0;
    ra->groups[ra->ngroups++] = ra->gid;
    FILE *gr = fopen("/etc/group", "re");
    if (!gr) return 1;
    while (fgets(line, sizeof line, gr)) {
        if (!colon_fields(line, fld, 4)) continue;
        gid_t g = (gid_t)strtoul(fld[2], NULL, 10);
        int member = 0;
        for (char *m = strtok(fld[3], ","); m && !member; m = strtok(NULL, ","))
            member = !strcmp(m, ra->name);
        int dup = 0;
        for (int i = 0; i < ra->ngroups; i++) dup |= ra->groups[i] == g;
        if (!member || dup) continue;
        if (ra->ngroups == RUN_AS_GROUPS) {
            fclose(gr);
            return 0;
        }
        ra->groups[ra->ngroups++] = g;
    }
    fclose(gr);
    return 1;
}

/* HOME and USER of `envp` set to the user's, unless the request's env named them. */
static int user_env(char **envp, const struct jfield *env, const struct run_as *ra) {
    struct jfield f[MAX_FIELDS];
    int nf = env && env->type == J_OTHER ? json_fields(env->val, env->vlen, f) : 0;
    static const char *const keys[] = {"HOME", "USER"};
    for (int k = 0; k < 2; k++) {
        int given = 0;
        for (int i = 0; i < nf; i++)
            given |= f[i].klen == strlen(keys[k]) && !memcmp(f[i].key, keys[k], f[i].klen);
        if (given) continue;
        size_t kl = strlen(keys[k]);
        for (char **e = envp; *e; e++) {
            if (strncmp(*e, keys[k], kl) || (*e)[kl] != '=') continue;
            const char *val = k == 0 ? ra->home : ra->name;
            char *kv = malloc(kl + strlen(val) + 2);
            if (!kv) return -1;
            sprintf(kv, "%s=%s", keys[k], val);
            free(*e);
            *e = kv;
        }
    }
    return 0;
}

static int op_exec(long long id, const struct jfield *f, int n, int stream) {
    const struct jfield *cmd = field(f, n, "cmd"), *cwdf = field(f, n, "cwd");
    const struct jfield *tf = field(f, n, "timeout"), *wf = field(f, n, "window");
    long long window = 0;
    if (wf && wf->type != J_NULL && (!is_int(wf, &window) || window < 0))
        return -1; /* agent.py answers with the exact error */
    char **argv = NULL, **envp = NULL, cwd[1024];
    int argc = 0;
    if (!cmd) return -1;
    const struct jfield *uf = field(f, n, "user");
    struct run_as run_as, *ra = NULL;
    if (uf && uf->type != J_NULL) { /* another user (E2B's, an image's USER) */
        char raw[sizeof run_as.name];
        long ul = uf->type == J_STR ? json_str(uf, raw, sizeof raw) : -1;
        if (ul < 0 || (size_t)ul != strlen(raw) || !lookup_run_as(raw, &run_as))
            return -1; /* agent.py answers, or resolves what this does not */
        ra = &run_as;
    }
    if (cmd->type == J_STR) {
        char *c = malloc(cmd->vlen * 4 + 8);
        long cl = c ? json_str(cmd, c, cmd->vlen * 4 + 8) : -1;
        if (cl < 0 || (size_t)cl != strlen(c)) {
            free(c);
            return -1;
        }
        argv = calloc(4, sizeof *argv);
        argv[0] = strdup("/bin/sh");
        argv[1] = strdup("-c");
        argv[2] = c;
    } else if (cmd->type == J_OTHER && cmd->val[0] == '[') {
        argv = json_strings(cmd->val, cmd->vlen, &argc);
    }
    if (!argv) return -1; /* malformed: agent.py answers with the exact error */
    envp = exec_env(field(f, n, "env"));
    if (!envp || (ra && user_env(envp, field(f, n, "env"), ra) != 0)) {
        free_strings(argv);
        if (envp) free_strings(envp);
        return -1;
    }
    double timeout = 0;
    int rc = -1;
    if (tf && tf->type != J_NULL && (!num(tf, &timeout) || timeout <= 0)) {
        fail(id, "EINVAL", "timeout must be a positive number");
        rc = 0;
        goto out;
    }
    if (!cwdf || cwdf->type == J_NULL) {
        snprintf(cwd, sizeof cwd, "%s", default_cwd);
        mkdirs(cwd);
        struct stat st;
        if (stat(cwd, &st) != 0 || !S_ISDIR(st.st_mode)) snprintf(cwd, sizeof cwd, "/");
    } else {
        struct stat st;
        long cl = cwdf->type == J_STR ? json_str(cwdf, cwd, sizeof cwd) : -1;
        if (cl < 0) goto out; /* not a string, or too long: agent.py answers */
        if ((size_t)cl != strlen(cwd)) { /* a \u0000 would cut the path short */
            static struct buf b;
            reply_start(&b, id, "error");
            put(&b, ",\"code\":\"EINVAL\",\"message\":\"cwd must not contain NUL bytes\","
                "\"field\":\"cwd\"");
            reply_end(&b);
            rc = 0;
            goto out;
        }
        if (stat(cwd, &st) != 0 || !S_ISDIR(st.st_mode)) {
            static struct buf b;
            char msg[1100];
            snprintf(msg, sizeof msg, "working directory does not exist: %s", cwd);
            reply_start(&b, id, "error");
            put(&b, ",\"code\":\"%s\",\"message\":",
                access(cwd, F_OK) == 0 ? "ENOTDIR" : "ENOENT");
            put_jstr(&b, msg);
            buf_add(&b, ",\"path\":", 8);
            put_jstr(&b, cwd);
            reply_end(&b);
            rc = 0;
            goto out;
        }
    }
    if (find_exec(id)) {
        char msg[100];
        snprintf(msg, sizeof msg, "exec id %lld is already running", id);
        fail(id, "EINVAL", msg);
        rc = 0;
        goto out;
    }
    struct buf first_in = {0};
    const struct jfield *inf = field(f, n, "stdin");
    if (stream && inf && inf->type == J_STR) {
        buf_reserve(&first_in, inf->vlen / 4 * 3 + 3);
        long got_in = b64decode(inf->val, inf->vlen, (unsigned char *)first_in.p,
                                first_in.cap);
        first_in.len = got_in > 0 ? (size_t)got_in : 0;
    } else if (stream && inf && inf->type != J_NULL) {
        goto out; /* not base64 text: agent.py answers */
    }
    rc = 0;
    int out_p[2], err_p[2], sync_p[2], in_p[2] = {-1, -1};
    if (pipe2(out_p, O_CLOEXEC) || pipe2(err_p, O_CLOEXEC) || pipe2(sync_p, O_CLOEXEC) ||
        (stream && pipe2(in_p, O_CLOEXEC))) {
        fail_errno(id, "pipe");
        free(first_in.p);
        goto out;
    }
    double start = mono();
    long long start_ms = now_ms();
    pid_t pid = fork();
    if (pid == 0) {
        sigset_t none;
        sigemptyset(&none);
        sigprocmask(SIG_SETMASK, &none, NULL);
        signal(SIGPIPE, SIG_DFL);
        setsid();
        if (stream) {
            dup2(in_p[0], 0);
        } else {
            int null = open("/dev/null", O_RDONLY);
            dup2(null, 0);
            if (null > 2) close(null);
        }
        dup2(out_p[1], 1);
        dup2(err_p[1], 2);
        /* As Popen(cwd=, user=, group=, extra_groups=): chdir first, then the ids. */
        if (chdir(cwd) == 0 &&
            (!ra || (setgroups((size_t)ra->ngroups, ra->groups) == 0 &&
                     setgid(ra->gid) == 0 && setuid(ra->uid) == 0))) {
            extern char **environ;
            environ = envp; /* execvp searches the command's own PATH, like Popen */
            execvp(argv[0], argv);
        }
        int e = errno;
        if (write(sync_p[1], &e, sizeof e) < 0) _exit(127);
        _exit(127);
    }
    close(out_p[1]);
    close(err_p[1]);
    close(sync_p[1]);
    if (stream) close(in_p[0]);
    int child_errno = 0;
    ssize_t got = pid > 0 ? read(sync_p[0], &child_errno, sizeof child_errno) : -1;
    close(sync_p[0]);
    if (pid < 0 || got > 0) {
        /* Behave like a shell: 127 for "not found", 126 for "cannot execute". */
        int e = pid < 0 ? errno : child_errno;
        char text[1200];
        snprintf(text, sizeof text, "boxd-agent: %s: %s\n", argv[0], strerror(e));
        struct exec tmp = {.id = id};
        snprintf(tmp.nonce, sizeof tmp.nonce, "%s", cur_nonce);
        exec_event(&tmp, "stderr", (const unsigned char *)text, strlen(text));
        static struct buf b;
        reply_start(&b, id, "result");
        put(&b, ",\"exit_code\":%d,\"signal\":null,\"timed_out\":false,\"duration\":%.6f",
            e == ENOENT ? 127 : 126, mono() - start);
        reply_end(&b);
        close(out_p[0]);
        close(err_p[0]);
        if (stream) close(in_p[1]);
        free(first_in.p);
        /* the failed child is reaped by reap() (no exec owns it) */
        goto out;
    }
    struct exec *x = calloc(1, sizeof *x);
    x->id = id;
    snprintf(x->nonce, sizeof x->nonce, "%s", cur_nonce);
    x->pid = pid;
    x->fd[0] = out_p[0];
    x->fd[1] = err_p[0];
    fcntl(x->fd[0], F_SETFL, O_NONBLOCK);
    fcntl(x->fd[1], F_SETFL, O_NONBLOCK);
    x->stream = stream;
    x->in_fd = in_p[1];
    x->inq = first_in;
    if (stream) fcntl(x->in_fd, F_SETFL, O_NONBLOCK);
    x->start = start;
    x->deadline = timeout > 0 ? start_ms + (long long)(timeout * 1000) : 0;
    x->last_data = start_ms;
    x->window = window;
    x->next = execs;
    execs = x;
    static struct buf b;
    reply_start(&b, id, "started");
    put(&b, ",\"pid\":%d", (int)pid);
    if (!strcmp(x->nonce, cur_nonce)) reply_end(&b);
    exec_feed(x);
out:
    free_strings(argv);
    free_strings(envp);
    return rc;
}

static void exec_close_stdin(struct exec *x) {
    if (x->in_fd >= 0) close(x->in_fd);
    x->in_fd = -1;
    free(x->inq.p);
    x->inq = (struct buf){0};
}

/* Write what the command's stdin can take now (its pipe is non-blocking). */
static void exec_feed(struct exec *x) {
    while (x->in_fd >= 0 && x->inq.len) {
        ssize_t w = write(x->in_fd, x->inq.p + x->inq.start, x->inq.len);
        if (w > 0) {
            buf_drop(&x->inq, (size_t)w);
            continue;
        }
        if (w < 0 && errno == EINTR) continue;
        if (w < 0 && errno == EAGAIN) return; /* full: poll for POLLOUT */
        exec_close_stdin(x); /* EPIPE: the command closed its stdin or exited */
        return;
    }
    if (x->in_fd >= 0 && x->in_eof) exec_close_stdin(x);
}

/* A stream exec nobody follows (its connection is gone: a fork child, a restore, a
   reconnect) is not read: its output waits in its pipes for the host that re-attaches
   (when the pipe is full, the command waits too). Other execs are read and dropped, so
   they run to their end. */
static int exec_followed(const struct exec *x) {
    return !x->stream || !strcmp(x->nonce, cur_nonce);
}

static void exec_read(struct exec *x, int k) {
    static unsigned char data[EXEC_CHUNK];
    ssize_t r = read(x->fd[k], data, sizeof data);
    if (r < 0 && (errno == EAGAIN || errno == EINTR)) return;
    if (r <= 0) {
        close(x->fd[k]);
        x->fd[k] = -1;
        return;
    }
    x->last_data = now_ms();
    exec_event(x, k ? "stderr" : "stdout", data, (size_t)r);
}

/* The host has not acknowledged a window of output: stop reading the pipes (the command
   then blocks on a full pipe) until it does, or until its connection is gone. */
static int exec_paused(struct exec *x) {
    if (!x->window || x->sent - x->acked < x->window) return 0;
    if (strcmp(x->nonce, cur_nonce)) {
        x->window = 0; /* nobody will acknowledge: its output is dropped from now on */
        return 0;
    }
    return 1;
}

/* Advance one exec: its timeout, the drain after exit, its result. Returns 1 when done. */
static int exec_step(struct exec *x) {
    long long t = now_ms();
    if (exec_paused(x)) { /* a pause is not silence: the drain limits count from its end */
        x->last_data = t;
        if (x->exited) x->exited_at = t;
    }
    if (x->deadline && !x->timed_out && t >= x->deadline) {
        x->timed_out = 1; /* TERM the group, KILL it after the grace if it is still there */
        x->kill_at = t + EXEC_KILL_GRACE_MS;
        kill(-x->pid, SIGTERM);
    } else if (x->kill_at && t >= x->kill_at) {
        x->kill_at = 0;
        kill(-x->pid, SIGKILL);
    }
    if (x->exited && (t - x->last_data > EXIT_DRAIN_IDLE_MS || t - x->exited_at > EXIT_DRAIN_MAX_MS))
        for (int k = 0; k < 2; k++)
            if (x->fd[k] >= 0) { /* background children still hold the pipe */
                close(x->fd[k]);
                x->fd[k] = -1;
            }
    if (x->exited && x->in_fd >= 0) exec_close_stdin(x);
    if (!x->exited || x->fd[0] >= 0 || x->fd[1] >= 0) return 0;
    if (x->timed_out) kill(-x->pid, SIGKILL); /* the whole group, not only the leader */
    static struct buf b;
    int code, sig = 0;
    if (WIFSIGNALED(x->status)) {
        sig = WTERMSIG(x->status);
        code = 128 + sig;
    } else {
        code = WEXITSTATUS(x->status);
    }
    reply_start(&b, x->id, "result");
    put(&b, ",\"exit_code\":%d,\"signal\":", code);
    if (sig)
        put(&b, "%d", sig);
    else
        put(&b, "null");
    put(&b, ",\"timed_out\":%s,\"duration\":%.6f", x->timed_out ? "true" : "false",
        mono() - x->start);
    if (!strcmp(x->nonce, cur_nonce)) reply_end(&b);
    return 1;
}

static void execs_step(void) {
    for (struct exec **pp = &execs; *pp;) {
        struct exec *x = *pp;
        if (exec_step(x)) {
            *pp = x->next;
            exec_close_stdin(x);
            free(x);
        } else {
            pp = &x->next;
        }
    }
}

/* Milliseconds until some exec needs attention without any I/O (-1: none). */
static int execs_timeout(void) {
    long long t = now_ms(), best = -1;
    for (struct exec *x = execs; x; x = x->next) {
        long long due = -1;
        if (x->deadline && !x->timed_out) due = x->deadline;
        if (x->kill_at) due = x->kill_at;
        if (x->exited) {
            long long drain = x->last_data + EXIT_DRAIN_IDLE_MS + 1;
            long long cap = x->exited_at + EXIT_DRAIN_MAX_MS + 1;
            long long d = drain < cap ? drain : cap;
            due = due < 0 || d < due ? d : due;
        }
        if (due >= 0 && (best < 0 || due < best)) best = due;
    }
    return best < 0 ? -1 : (int)(best > t ? best - t : 0);
}

static int op_kill(long long id, const struct jfield *f, int n) {
    long long exec_id, sig = SIGKILL;
    if (!is_int(field(f, n, "exec_id"), &exec_id)) return -1;
    struct exec *x = find_exec(exec_id);
    if (!x || x->exited) return -1; /* agent.py's, or gone: agent.py answers ESRCH */
    const struct jfield *sf = field(f, n, "signal");
    if (sf && sf->type != J_NULL && !is_int(sf, &sig)) {
        fail(id, "EINVAL", "signal must be an integer");
        return 0;
    }
    static struct buf b;
    int ok = kill(-x->pid, (int)sig) == 0;
    reply_start(&b, id, "result");
    put(&b, ",\"delivered\":%s", ok ? "true" : "false");
    reply_end(&b);
    return 0;
}

/* 1.3: the host consumed `bytes` of exec `req`'s output. Others' acks go to agent.py. */
static int op_ack(long long id, const struct jfield *f, int n) {
    long long req, total;
    if (!is_int(field(f, n, "req"), &req) || !is_int(field(f, n, "bytes"), &total)) return -1;
    struct exec *x = find_exec(req);
    if (!x) return -1;
    if (total > x->acked) x->acked = total;
    static struct buf b;
    reply_start(&b, id, "result");
    put(&b, ",\"known\":true");
    reply_end(&b);
    return 0;
}

static int op_stdin(long long id, const struct jfield *f, int n) {
    long long exec_id;
    struct exec *x;
    if (!is_int(field(f, n, "exec_id"), &exec_id) || !(x = find_exec(exec_id))) return -1;
    if (!x->stream) {
        fail(id, "EINVAL", "exec was not started with stdin_stream");
        return 0;
    }
    const struct jfield *d = field(f, n, "data"), *eof = field(f, n, "eof");
    if (d && d->type != J_STR && d->type != J_NULL) {
        fail(id, "EINVAL", "data must be base64 text");
        return 0;
    }
    size_t max = d && d->type == J_STR ? d->vlen / 4 * 3 + 3 : 0;
    if (x->inq.len + max > (size_t)QUEUE_MAX) {
        char msg[200];
        snprintf(msg, sizeof msg, "stdin not taken: the command has not read the %zu bytes "
                 "sent before (limit %ld)", x->inq.len, (long)QUEUE_MAX);
        fail(id, "ENOBUFS", msg);
        return 0;
    }
    long size = 0;
    if (max) {
        buf_reserve(&x->inq, max);
        size = b64decode(d->val, d->vlen, (unsigned char *)x->inq.p + x->inq.start + x->inq.len,
                         max);
        if (size < 0) size = 0;
        /* Bytes for a stdin that is closed already are dropped, as agent.py does. */
        if (x->in_fd >= 0 && !x->in_eof) x->inq.len += (size_t)size;
    }
    if (eof && eof->vlen == 4 && !memcmp(eof->val, "true", 4)) x->in_eof = 1;
    exec_feed(x);
    const struct jfield *reply = field(f, n, "reply");
    if (reply && reply->vlen == 5 && !memcmp(reply->val, "false", 5)) return 0; /* 1.4 */
    static struct buf b;
    reply_start(&b, id, "result");
    put(&b, ",\"size\":%ld", size);
    reply_end(&b);
    return 0;
}

/* Follow a running exec of ours again, on this connection and under this request's id
   (a fork child, a restored machine, a reconnect). Returns -1 for agent.py's execs. */
static int op_attach(long long id, const struct jfield *f, int n) {
    long long exec_id;
    struct exec *x;
    if (!is_int(field(f, n, "exec_id"), &exec_id) || !(x = find_exec(exec_id))) return -1;
    if (exec_id != id && find_exec(id)) {
        fail(id, "EINVAL", "this request id is an exec's already");
        return 0;
    }
    x->id = id;
    snprintf(x->nonce, sizeof x->nonce, "%s", cur_nonce);
    x->window = 0; /* the new host acknowledges nothing it did not ask a window for */
    static struct buf b;
    reply_start(&b, id, "started");
    put(&b, ",\"pid\":%d,\"attached\":true", (int)x->pid);
    reply_end(&b);
    return 0;
}

/* A resize (1.7) of one of our execs: none runs on a pty (those are agent.py's).
   Returns -1 for agent.py's execs. */
static int op_resize(long long id, const struct jfield *f, int n) {
    long long exec_id;
    struct exec *x;
    if (!is_int(field(f, n, "exec_id"), &exec_id) || !(x = find_exec(exec_id))) return -1;
    char msg[100];
    snprintf(msg, sizeof msg, "exec %lld does not run on a pty", exec_id);
    fail(id, x->exited ? "ESRCH" : "EINVAL", msg);
    return 0;
}

/* Whether agent.py answers this relayed request with a result or an error of its own:
   only those are tracked in `inflight` (an id tracked and never ended would stay there
   for the connection's life, and be "failed" if agent.py restarts). A write's later
   chunks are answered under the first chunk's id (once, at the end, or at once on an
   error: the chunks after an error get nothing); a stdin with "reply": false is
   answered only on an error, under its exec's id, which is tracked already. */
static int answered(const char *name, const struct jfield *f, int nf) {
    if (!strcmp(name, "write")) return field(f, nf, "path") != NULL;
    if (!strcmp(name, "stdin")) {
        const struct jfield *reply = field(f, nf, "reply");
        return !(reply && reply->vlen == 5 && !memcmp(reply->val, "false", 5));
    }
    return 1;
}

static void host_line(const char *line, size_t n) {
    struct jfield f[MAX_FIELDS];
    int nf = json_fields(line, n, f);
    long long id = 0;
    int has_id = nf >= 0 && is_int(field(f, nf, "id"), &id);
    char name[32] = "";
    if (has_id) {
        const struct jfield *op = field(f, nf, "op");
        if (op && op->type == J_STR && json_str(op, name, sizeof name) > 0) {
            if (!strcmp(name, "hello")) {
                op_hello(id, f, nf);
                return;
            }
            if (!strcmp(name, "ping")) {
                op_ping(id);
                return;
            }
            if (!strcmp(name, "identity")) {
                op_identity(id, f, nf);
                return;
            }
            if (!strcmp(name, "sync")) {
                op_sync(id);
                return;
            }
            const struct jfield *in = field(f, nf, "stdin"), *st = field(f, nf, "stdin_stream");
            int no_stdin = (!in || in->type == J_NULL) &&
                           (!st || (st->vlen == 5 && !memcmp(st->val, "false", 5)) ||
                            st->type == J_NULL);
            int stream = st && st->vlen == 4 && !memcmp(st->val, "true", 4);
            /* An exec on a pty (1.7) and its resizes are agent.py's. */
            const struct jfield *pty = field(f, nf, "pty");
            int on_pty = pty && pty->type != J_NULL;
            if (!strcmp(name, "exec") && !on_pty && (no_stdin || stream) &&
                op_exec(id, f, nf, stream) == 0)
                return;
            if (!strcmp(name, "kill") && op_kill(id, f, nf) == 0) return;
            if (!strcmp(name, "stdin") && op_stdin(id, f, nf) == 0) return;
            if (!strcmp(name, "ack") && op_ack(id, f, nf) == 0) return;
            if (!strcmp(name, "attach") && op_attach(id, f, nf) == 0) return;
            if (!strcmp(name, "resize") && op_resize(id, f, nf) == 0) return;
        } else {
            name[0] = 0; /* json_str may have left part of a name */
        }
    }
    /* Everything else (and anything malformed: agent.py logs it) goes to agent.py. */
    if (py_fd < 0) {
        if (has_id) fail(id, "EINTERNAL", "the guest agent is restarting; retry");
        return;
    }
    py_sync_nonce();
    if (has_id && answered(name, f, nf)) inflight_add(id);
    long long old_id;
    if (has_id && !strcmp(name, "attach") && is_int(field(f, nf, "exec_id"), &old_id))
        inflight_remove(old_id); /* agent.py's exec goes by the attach's id from now on */
    py_send(line, n);
    py_send("\n", 1);
}

/* The host went away (EOF, or POLLHUP on the virtio port): poll it again in RETRY_MS. */
static void host_hangup(void) {
    int was = host_present;
    host_present = 0;
    if (opt_connect) host_close();
    host_retry_at = now_ms() + RETRY_MS;
    if (!was) return;
    /* A partial line can never complete. agent.py hears of the change (a nonce no host
       uses) with the next request relayed to it, not now: in a fork child that has just
       started, waking the interpreter would cost more than the child's whole hello. */
    buf_clear(&hbuf);
    n_inflight = 0;
    snprintf(cur_nonce, sizeof cur_nonce, "hangup-%lu", ++hangups);
}

static void host_readable(void) {
    buf_reserve(&hbuf, 1 << 20);
    ssize_t r = read(host_fd, hbuf.p + hbuf.start + hbuf.len, 1 << 20);
    if (r < 0 && (errno == EAGAIN || errno == EINTR)) return;
    if (r <= 0) {
        if (r < 0) logf_("channel read error: %s", strerror(errno));
        host_hangup();
        return;
    }
    host_present = 1;
    hbuf.len += (size_t)r;
    for (;;) {
        char *s = hbuf.p + hbuf.start;
        char *nl = memchr(s, '\n', hbuf.len);
        if (!nl) break;
        size_t n = (size_t)(nl - s);
        const char *p = s;
        size_t k = n;
        while (k && (*p == ' ' || *p == '\t' || *p == '\r')) p++, k--;
        if (k) host_line(s, n);
        buf_drop(&hbuf, n + 1);
    }
    if (hbuf.len > (size_t)MAX_LINE) {
        logf_("line too long; dropped");
        buf_clear(&hbuf);
    }
}

/* ------------------------------------------------------------------ main loop */

static void reap(int sfd) {
    struct signalfd_siginfo si;
    while (read(sfd, &si, sizeof si) == sizeof si) {
    }
    int status;
    pid_t pid;
    while ((pid = waitpid(-1, &status, WNOHANG)) > 0) {
        if (pid == py_pid) {
            logf_("agent.py exited (status %d); restarting it", status);
            py_gone();
            continue;
        }
        for (struct exec *x = execs; x; x = x->next)
            if (x->pid == pid && !x->exited) {
                x->exited = 1;
                x->status = status;
                x->exited_at = now_ms();
                /* The drain's quiet counts from the exit, never from before it: what the
                   command wrote just before exiting may not have been polled yet (this
                   wake-up was for another child), and its silence before that is no
                   reason to stop reading. */
                if (x->last_data < x->exited_at) x->last_data = x->exited_at;
            }
    }
}

static void usage(void) {
    fprintf(stderr, "usage: boxd-init [--connect SOCK | --stdio] [--host-clock] "
                    "[--memory-mib N] [--sysroot DIR] [--python PY] [--python-arg A]... "
                    "[--agent PATH] [-- agent args]\n"
                    "       boxd-init --dial PORT\n");
    exit(2);
}

static void ignore_signal(int sig) { (void)sig; }

/* --memory-mib: the guest's own OOM killer (gVisor). runsc has none: a guest past the
 * sandbox's cgroup limit got the whole sandbox killed. Every check (MEM_CHECK_MS apart
 * while memory is plentiful, closer as it runs out: mem_check_interval), the guest's
 * process memory (/proc/meminfo: MemTotal - MemFree - Cached; gVisor counts tmpfs and
 * the in-memory root overlay's files as Cached, and those are bounded by the cgroup) is
 * compared with the machine's memory; past it, the process with the largest resident
 * set (not PID 1, not agent.py) gets SIGKILL, and no other until it is gone. Only as
 * PID 1. */
#define MEM_CHECK_MS 100
#define MEM_CHECK_MIN_MS 5
/* A process allocating as fast as a guest can (measured: 16 MiB every few ms under
 * gVisor) outran a fixed 100 ms check by 144 MiB on a loaded host. The next check is due
 * in as many ms as a quarter of the MiB left, so the headroom is read again well before
 * a fast allocator can use it up: 100 ms at 400 MiB or more left, 5 ms near the limit. */
static int mem_check_interval(long used_mib) {
    long left = opt_memory_mib - used_mib;
    long ms = left / 4;
    return (int)(ms < MEM_CHECK_MIN_MS ? MEM_CHECK_MIN_MS : ms > MEM_CHECK_MS ? MEM_CHECK_MS : ms);
}
static long long mem_check_at;
static pid_t mem_victim = -1;

static long meminfo_used_mib(void) {
    FILE *f = fopen("/proc/meminfo", "re");
    if (!f) return -1;
    char line[256];
    long total = -1, free_kb = -1, cached = 0, v;
    while (fgets(line, sizeof line, f)) {
        if (sscanf(line, "MemTotal: %ld kB", &v) == 1) total = v;
        else if (sscanf(line, "MemFree: %ld kB", &v) == 1) free_kb = v;
        else if (sscanf(line, "Cached: %ld kB", &v) == 1) cached = v;
    }
    fclose(f);
    return total < 0 || free_kb < 0 ? -1 : (total - free_kb - cached) / 1024;
}

/* A process's resident set in kB (-1: gone, or a zombie) and its name. */
static long process_rss(pid_t pid, char *name, size_t cap) {
    char path[64], line[256];
    snprintf(path, sizeof path, "/proc/%d/status", (int)pid);
    FILE *f = fopen(path, "re");
    if (!f) return -1;
    long rss = -1, v;
    if (name && cap) name[0] = 0;
    while (fgets(line, sizeof line, f)) {
        if (name && cap && !strncmp(line, "Name:", 5)) {
            char *n = line + 5;
            while (*n == ' ' || *n == '\t') n++;
            size_t k = strcspn(n, "\n");
            if (k >= cap) k = cap - 1;
            memcpy(name, n, k);
            name[k] = 0;
        } else if (sscanf(line, "VmRSS: %ld kB", &v) == 1) {
            rss = v;
        }
    }
    fclose(f);
    return rss;
}

static void memory_check(void) {
    if (opt_memory_mib <= 0 || getpid() != 1) return;
    long long t = now_ms();
    if (t < mem_check_at) return;
    mem_check_at = t + MEM_CHECK_MS;
    if (mem_victim > 0) {
        if (process_rss(mem_victim, NULL, 0) >= 0) { /* still dying */
            mem_check_at = t + MEM_CHECK_MIN_MS;
            return;
        }
        mem_victim = -1;
    }
    long used = meminfo_used_mib();
    if (used >= 0) mem_check_at = t + mem_check_interval(used);
    if (used < 0 || used <= opt_memory_mib) return;
    DIR *d = opendir("/proc");
    if (!d) return;
    pid_t best = -1;
    long best_rss = 0;
    char best_name[64] = "";
    struct dirent *e;
    while ((e = readdir(d))) {
        char *end;
        long pid = strtol(e->d_name, &end, 10);
        if (*end || pid <= 1 || pid == py_pid) continue;
        char name[64];
        long rss = process_rss((pid_t)pid, name, sizeof name);
        if (rss > best_rss) {
            best = (pid_t)pid;
            best_rss = rss;
            snprintf(best_name, sizeof best_name, "%s", name);
        }
    }
    closedir(d);
    if (best <= 0 || kill(best, SIGKILL) != 0) return;
    mem_victim = best;
    logf_("out of memory: killed process %d (%s), %ld MiB resident: the machine's "
          "processes used %ld MiB of its %ld MiB", (int)best, best_name, best_rss / 1024,
          used, opt_memory_mib);
}

/* boxd-init --dial PORT: connect to 127.0.0.1:PORT, say "+" on stdout, then relay stdin
 * to the socket and the socket to stdout until the socket's reading half ends (stdin's
 * EOF shuts down its writing half). A machine URL's connection to a guest port (every
 * port on gVisor, ports but 8080 on QEMU; the host's AgentClient.dial). Exit 1 when the
 * connect fails, the reason on stderr. */
static int write_all(int fd, const char *p, ssize_t n) {
    while (n > 0) {
        ssize_t w = write(fd, p, (size_t)n);
        if (w < 0 && errno == EINTR) continue;
        if (w <= 0) return -1;
        p += w;
        n -= w;
    }
    return 0;
}

static int dial_main(const char *port_s) {
    char *end;
    long port = strtol(port_s, &end, 10);
    if (*end || port < 1 || port > 65535) {
        fprintf(stderr, "boxd-init --dial: bad port %s\n", port_s);
        return 2;
    }
    signal(SIGPIPE, SIG_IGN);
    int sock = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    struct sockaddr_in sa = {.sin_family = AF_INET, .sin_port = htons((uint16_t)port)};
    sa.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    if (sock < 0 || connect(sock, (struct sockaddr *)&sa, sizeof sa) != 0) {
        fprintf(stderr, "connect to 127.0.0.1:%ld: %s\n", port, strerror(errno));
        return 1;
    }
    if (write_all(1, "+", 1) != 0) return 1;
    static char buf[65536];
    struct pollfd fds[2] = {{.fd = 0, .events = POLLIN}, {.fd = sock, .events = POLLIN}};
    for (;;) {
        if (poll(fds, 2, -1) < 0) {
            if (errno == EINTR) continue;
            return 1;
        }
        if (fds[0].revents) {
            ssize_t n = read(0, buf, sizeof buf);
            if (n < 0 && errno == EINTR) continue;
            if (n <= 0) {
                shutdown(sock, SHUT_WR);
                fds[0].fd = -1; /* poll ignores it from now on */
            } else if (write_all(sock, buf, n) != 0) {
                return 0; /* the server is gone */
            }
        }
        if (fds[1].revents) {
            ssize_t n = read(sock, buf, sizeof buf);
            if (n < 0 && errno == EINTR) continue;
            if (n <= 0 || write_all(1, buf, n) != 0) return 0;
        }
    }
}

int main(int argc, char **argv) {
    if (argc == 3 && !strcmp(argv[1], "--dial")) return dial_main(argv[2]);
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        if (!strcmp(a, "--")) {
            agent_extra = argv + i + 1;
            n_agent_extra = argc - i - 1;
            break;
        }
        if (!strcmp(a, "--stdio")) {
            opt_stdio = 1;
            continue;
        }
        if (!strcmp(a, "--host-clock")) {
            opt_host_clock = 1;
            continue;
        }
        if (i + 1 >= argc) usage();
        if (!strcmp(a, "--connect")) opt_connect = argv[++i];
        else if (!strcmp(a, "--sysroot")) opt_sysroot = argv[++i];
        else if (!strcmp(a, "--python")) opt_python = argv[++i];
        else if (!strcmp(a, "--python-arg") && n_python_args < MAX_PYTHON_ARGS)
            python_args[n_python_args++] = argv[++i];
        else if (!strcmp(a, "--agent")) opt_agent = argv[++i];
        else if (!strcmp(a, "--memory-mib")) opt_memory_mib = strtol(argv[++i], NULL, 10);
        else usage();
    }
    for (int i = 0; i + 1 < n_agent_extra; i++)
        if (!strcmp(agent_extra[i], "--default-cwd")) default_cwd = agent_extra[i + 1];
    started = wall();
    if (!opt_sysroot) urandom_fd = open("/dev/urandom", O_WRONLY | O_CLOEXEC);
    if (opt_stdio && opt_connect) usage();
    if (getpid() != 1) prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0);
    if (getpid() == 1) {
        /* PID 1 survives stray TERM/INT/HUP (`kill -TERM 1`, `pkill` in a guest), as
           agent.py does: a kernel spares an init without handlers, a gVisor sandbox
           might not. A handler, not SIG_IGN, so commands get the default back on exec. */
        struct sigaction sa = {.sa_handler = ignore_signal};
        sigemptyset(&sa.sa_mask);
        sigaction(SIGTERM, &sa, NULL);
        sigaction(SIGINT, &sa, NULL);
        sigaction(SIGHUP, &sa, NULL);
    }
    signal(SIGPIPE, SIG_IGN);
    sigset_t chld;
    sigemptyset(&chld);
    sigaddset(&chld, SIGCHLD);
    sigprocmask(SIG_BLOCK, &chld, NULL);
    int sfd = signalfd(-1, &chld, SFD_NONBLOCK | SFD_CLOEXEC);
    logf_("boxd-init %s started", PROTOCOL_VERSION);
    if (getpid() == 1 && !opt_sysroot) {
        /* The machine's own directory (identity, the API socket and credential, the
           client): 0755 root. A gVisor sandbox makes it 0777 as the mount point of the
           client's bind mount; done here, before any request is served. */
        struct stat st;
        if (stat("/" IDENTITY_DIR, &st) == 0 && st.st_uid == 0 && (st.st_mode & 07777) != 0755 &&
            chmod("/" IDENTITY_DIR, 0755) != 0)
            logf_("cannot make /%s 0755: %s", IDENTITY_DIR, strerror(errno));
    }
    py_spawn();

    for (;;) {
        long long t = now_ms();
        if (py_fd < 0 && py_pid < 0 && t >= py_restart_at) py_spawn();
        if (host_fd < 0 && t >= host_retry_at) host_open();
        int nx = 0;
        for (struct exec *x = execs; x; x = x->next) nx += 3;
        static struct pollfd *p;
        static int pcap;
        if (pcap < nx + 3) {
            pcap = (nx + 3) * 2;
            p = realloc(p, (size_t)pcap * sizeof *p);
            if (!p) abort();
        }
        int np = 0, ip = -1, ih = -1;
        p[np++] = (struct pollfd){sfd, POLLIN, 0};
        if (py_fd >= 0) {
            ip = np;
            p[np++] = (struct pollfd){py_fd, (short)(POLLIN | (pyq.len ? POLLOUT : 0)), 0};
        }
        t = now_ms();
        /* Backpressure: while agent.py has not taken QUEUE_MAX bytes of relayed requests
           (a big upload), stop reading the host; its writes then wait in the channel. */
        if (host_fd >= 0 && t >= host_retry_at && pyq.len < QUEUE_MAX) {
            ih = np;
            p[np++] = (struct pollfd){host_fd, POLLIN, 0};
        }
        int timeout = -1; /* host and agent polled: sleep until one of them speaks */
        if (ih < 0 && pyq.len < QUEUE_MAX)
            timeout = (int)(host_retry_at > t ? host_retry_at - t : 0);
        if (py_fd < 0 && py_pid < 0) {
            int w = (int)(py_restart_at > t ? py_restart_at - t : 0);
            timeout = timeout < 0 || w < timeout ? w : timeout;
        }
        int xw = execs_timeout();
        if (xw >= 0) timeout = timeout < 0 || xw < timeout ? xw : timeout;
        if (opt_memory_mib > 0 && getpid() == 1) {
            int mw = (int)(mem_check_at > t ? mem_check_at - t : 0);
            timeout = timeout < 0 || mw < timeout ? mw : timeout;
        }
        int ix = np;
        for (struct exec *x = execs; x; x = x->next) { /* an fd of -1 is ignored */
            int read_it = exec_followed(x) && !exec_paused(x);
            for (int k = 0; k < 2; k++)
                p[np++] = (struct pollfd){read_it ? x->fd[k] : -1, POLLIN, 0};
            p[np++] = (struct pollfd){x->inq.len ? x->in_fd : -1, POLLOUT, 0};
        }
        if (poll(p, (nfds_t)np, timeout) < 0) {
            if (errno != EINTR) logf_("poll: %s", strerror(errno));
            continue;
        }
        if (p[0].revents) reap(sfd);
        {
            int j = ix;
            for (struct exec *x = execs; x && j < np; x = x->next, j++) {
                for (int k = 0; k < 2; k++, j++)
                    if (x->fd[k] >= 0 && p[j].fd == x->fd[k] && p[j].revents) exec_read(x, k);
                if (x->in_fd >= 0 && p[j].fd == x->in_fd && p[j].revents) exec_feed(x);
            }
        }
        if (ip >= 0 && py_fd >= 0) {
            if (p[ip].revents & POLLIN) py_readable();
            if (py_fd >= 0 && (p[ip].revents & POLLOUT)) py_flush();
        }
        if (ih >= 0 && host_fd >= 0) {
            short rev = p[ih].revents;
            if (rev & POLLIN) {
                host_readable();
            } else if (rev & (POLLHUP | POLLERR | POLLNVAL)) {
                host_hangup(); /* virtio: POLLHUP until a host connects */
            }
        }
        if (py_fd >= 0 && pyq.len) py_flush();
        execs_step();
        memory_check();
    }
}
