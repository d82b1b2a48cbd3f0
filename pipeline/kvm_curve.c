/* kvm_curve.c: CurveZMQ key files, client/server socket setup and a ZAP handler that
 * accepts only listed client keys. */
#include "pipeline/kvm_curve.h"
#include "pipeline/kvm_jobcfg.h"
#include "common/kvm_error.h"
#include "common/kvm_log.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/vfs.h>
#include <time.h>
#include <unistd.h>
#include <zmq.h>

int kvm_curve_keygen(const char *prefix)
{
    if (!zmq_has("curve")) return kvm_err(KVM_ENOTSUP, "this libzmq has no CURVE support");
    char pub[41], sec[41], path[2][4096], tmp[2][4200];
    if (zmq_curve_keypair(pub, sec) != 0) return kvm_err(KVM_EIO, "zmq_curve_keypair: %s", zmq_strerror(errno));
    const char *keys[2] = {pub, sec}, *ext[2] = {"public", "secret"};
    /* Both files are written beside their names first and renamed over them only when both are
     * complete: opening the names themselves (O_TRUNC) kept an existing secret file's mode, so
     * --force over a world-readable one wrote the new secret key world-readable, and a failed
     * write (a full disk) left an empty file or a new public half beside the old secret one. */
    mode_t um = umask(0);
    umask(um);
    int made[2] = {0, 0}, rc = 0;
    for (int i = 0; i < 2 && !rc; i++) {
        snprintf(path[i], sizeof path[i], "%s.%s", prefix, ext[i]);
        snprintf(tmp[i], sizeof tmp[i], "%s.XXXXXX", path[i]);
        int fd = mkstemp(tmp[i]); /* mode 0600 */
        if (fd < 0) {
            rc = kvm_err(KVM_EIO, "%s: %s", path[i], strerror(errno));
            break;
        }
        made[i] = 1;
        char line[42];
        snprintf(line, sizeof line, "%s\n", keys[i]);
        ssize_t w = write(fd, line, 41);
        int e = w < 0 ? errno : w != 41 ? ENOSPC : 0;
        if (!e && i == 0 && fchmod(fd, 0644 & ~um)) e = errno;
        if (!e && fsync(fd)) e = errno;
        if (close(fd) && !e) e = errno;
        if (e) rc = kvm_err(KVM_EIO, "%s: write failed: %s", path[i], strerror(e));
    }
    for (int i = 1; i >= 0 && !rc; i--) /* the secret half first: a public file always has its secret */
        if (rename(tmp[i], path[i])) rc = kvm_err(KVM_EIO, "%s: %s", path[i], strerror(errno));
        else made[i] = 0;
    for (int i = 0; i < 2; i++)
        if (made[i]) unlink(tmp[i]);
    return rc;
}

/* The secret key files already warned about in this process (device, inode, mode, change
 * time): a server reads its key twice (the pair check, then the socket), and one warning says it
 * all. The change time tells a new file that reuses a removed one's inode (a key made again)
 * from the same file. */
static pthread_mutex_t warned_mu = PTHREAD_MUTEX_INITIALIZER;
static struct stat warned[16];
static int n_warned;

/* 1 the first time this file, with this mode, is seen here (then recorded), else 0. */
static int first_warning(const struct stat *st)
{
    pthread_mutex_lock(&warned_mu);
    int seen = 0;
    for (int i = 0; i < n_warned && !seen; i++)
        seen = warned[i].st_dev == st->st_dev && warned[i].st_ino == st->st_ino && warned[i].st_mode == st->st_mode &&
               warned[i].st_ctim.tv_sec == st->st_ctim.tv_sec && warned[i].st_ctim.tv_nsec == st->st_ctim.tv_nsec;
    if (!seen && n_warned < 16) warned[n_warned++] = *st;
    pthread_mutex_unlock(&warned_mu);
    return !seen;
}

/* A secret key others may read is warned about, not refused: a key copied with mode 0644 (a
 * Kubernetes secret's default mode, a hand-made file) ran before, and refusing would stop such
 * a deployment at its next restart; the warning names the fix. One that every user may write
 * is refused: anyone on the machine could put in a key of theirs (to read the traffic, or pass
 * as this side), and a key in that state cannot be trusted at all. Group write alone is warned
 * about: with Debian's user private groups (umask 002) the group is the owner alone. */
const char *kvm_curve__modeless_fs(long f_type)
{
    switch ((unsigned long)f_type & 0xffffffffUL) {
    case 0x4d44UL:
        return "vfat/FAT";
    case 0x2011bab0UL:
        return "exFAT";
    case 0x5346544eUL:
        return "NTFS (the kernel's ntfs driver)";
    case 0x7366746eUL:
        return "NTFS (ntfs3)";
    case 0x65735546UL:
        return "a FUSE filesystem";
    case 0xff534d42UL:
        return "SMB/CIFS";
    case 0xfe534d42UL:
        return "SMB2/CIFS";
    case 0x517bUL:
        return "SMB";
    case 0x01021997UL:
        return "9p (a VM's or WSL2's share of its host's folder)";
    default:
        return NULL;
    }
}

static int secret_mode_check(const char *path, int fd, const struct stat *st)
{
    const unsigned mode = (unsigned)(st->st_mode & 07777);
    struct statfs fs;
    const char *modeless = fstatfs(fd, &fs) == 0 ? kvm_curve__modeless_fs((long)fs.f_type) : NULL;
    char fix[4600];
    if (modeless) /* chmod may succeed there and change nothing (unless the mount keeps modes): say what else */
        snprintf(fix, sizeof fix,
                 "run chmod 600 %s; the file is on %s, which often keeps no Unix permissions of its own: if the mode "
                 "stays as it is, copy the key to a Linux filesystem (ext4, xfs, tmpfs) with mode 600 and name "
                 "that copy",
                 path, modeless);
    else
        snprintf(fix, sizeof fix, "run chmod 600 %s", path);
    if (st->st_mode & S_IWOTH)
        return kvm_err(KVM_EINVAL,
                       "secret key file %s is writable by every user (mode %04o): anyone on this machine could "
                       "replace the key; refused: make a new pair with kvmill keygen, or check the key and %s",
                       path, mode, fix);
    /* execute bits alone (0610) let no one read or change the key: no warning for them */
    const int readable = (st->st_mode & (S_IRGRP | S_IROTH)) != 0, writable = (st->st_mode & S_IWGRP) != 0;
    if ((readable || writable) && first_warning(st)) {
        char octal[8];
        snprintf(octal, sizeof octal, "%04o", mode);
        kvm_log(KVM_LOG_WARN, "key_file_mode", (kvm_log_field[]){KVM_LOG_S("path", path), KVM_LOG_S("mode", octal)}, 2,
                "warning: secret key file %s has mode %s: other users can %s it; %s%s", path, octal,
                readable && writable ? "read or change"
                : readable           ? "read"
                                     : "change",
                fix, modeless ? "" : " (a mounted Kubernetes secret: defaultMode 0400)");
    }
    return 0;
}

/* Reads a key file; secret = 1 also checks its mode (secret_mode_check). The file is opened
 * without blocking and its type checked on the open descriptor (fstat): fopen of a FIFO waited
 * for a writer for ever (ask, a stage; the ZAP thread reading authorized_keys/x.public stalled
 * every client's handshake), and a check by name before the open could be raced. A symbolic
 * link is followed and its target checked, as ssh does: mounted secrets are often links. */
static int key_read(const char *path, char key[41], int secret)
{
    /* a socket, FIFO or device is refused before the open too: open fails on a socket (ENXIO,
     * a misleading message) and opening a device (a tty, a tape) can have effects of its own */
    struct stat pre;
    if (stat(path, &pre) == 0 && !S_ISREG(pre.st_mode) && !S_ISDIR(pre.st_mode))
        return kvm_err(KVM_EFORMAT, "key file %s: not a regular file (a FIFO, socket or device)", path);
    int fd = open(path, O_RDONLY | O_NONBLOCK | O_CLOEXEC);
    if (fd < 0) return kvm_err(errno == ENOENT ? KVM_ENOTFOUND : KVM_EIO, "key file %s: %s", path, strerror(errno));
    struct stat st;
    int rc = 0;
    if (fstat(fd, &st))
        rc = kvm_err(KVM_EIO, "key file %s: %s", path, strerror(errno));
    else if (S_ISDIR(st.st_mode))
        rc = kvm_err(KVM_EIO, "key file %s: %s", path, strerror(EISDIR));
    else if (!S_ISREG(st.st_mode))
        rc = kvm_err(KVM_EFORMAT, "key file %s: not a regular file (a FIFO, socket or device)", path);
    else if (secret)
        rc = secret_mode_check(path, fd, &st);
    char buf[128] = {0};
    ssize_t n = 0; /* to the end of the file or a full buffer: one read may return less */
    while (!rc && n < (ssize_t)sizeof buf - 1) {
        ssize_t r = read(fd, buf + n, sizeof buf - 1 - (size_t)n);
        if (r < 0 && errno == EINTR) continue;
        if (r < 0) rc = kvm_err(KVM_EIO, "key file %s: %s", path, strerror(errno));
        if (r <= 0) break;
        n += r;
    }
    close(fd);
    if (rc) return rc;
    while (n > 0 && (buf[n - 1] == '\n' || buf[n - 1] == '\r' || buf[n - 1] == ' ')) buf[--n] = '\0';
    uint8_t raw[32];
    if (n != 40 || !zmq_z85_decode(raw, buf)) return kvm_err(KVM_EFORMAT, "key file %s: not a 40-character Z85 CurveZMQ key", path);
    memcpy(key, buf, 41);
    return 0;
}

int kvm_curve_read_key(const char *path, char key[41]) { return key_read(path, key, 0); }

int kvm_curve_read_secret_key(const char *path, char key[41]) { return key_read(path, key, 1); }

/* 1 when public_file holds the public half of secret_file's key, 0 when it does not, or the
 * error (< 0, message set) of a file that does not read as a key. */
static int pair_matches(const char *secret_file, const char *public_file)
{
    char sec[41], pub[41], derived[41];
    int rc;
    if ((rc = kvm_curve_read_secret_key(secret_file, sec)) || (rc = kvm_curve_read_key(public_file, pub))) return rc;
    if (zmq_curve_public(derived, sec) != 0) return kvm_err(KVM_EIO, "zmq_curve_public: %s", zmq_strerror(errno));
    return !strcmp(derived, pub);
}

int kvm_curve_check_pair(const char *secret_file, const char *public_file)
{
    int rc = pair_matches(secret_file, public_file);
    if (rc == 0)
        return kvm_err(KVM_EMISMATCH, "[security] server_public_key %s is not the public half of server_secret_key %s",
                       public_file, secret_file);
    return rc < 0 ? rc : 0;
}

int kvm_curve_check_client_pair(const char *secret_file, const char *public_file)
{
    int rc = pair_matches(secret_file, public_file);
    if (rc == 0)
        return kvm_err(KVM_EMISMATCH,
                       "client public key %s is not the public half of client secret key %s (use the .public and "
                       ".secret files of one kvmill keygen)",
                       public_file, secret_file);
    return rc < 0 ? rc : 0;
}

/* A prefix test took tcp://127.example.com:P (a name, anywhere) for this host and let a client
 * talk to it without CurveZMQ, and refused tcp://LOCALHOST:P and tcp://0177.0.0.1:P as not local. */
int kvm_curve_is_local(const char *ep) { return kvm_jobcfg_is_loopback(ep); }

int kvm_curve_client(void *sock, const char *server_key_file, const char *public_file, const char *secret_file)
{
    if (!server_key_file && !public_file && !secret_file) return 0;
    if (!server_key_file || !public_file || !secret_file)
        return kvm_err(KVM_EINVAL, "CurveZMQ client needs the server public key and this side's public and secret keys");
    char srv[41], pub[41], sec[41];
    int rc;
    if ((rc = kvm_curve_read_key(server_key_file, srv)) || (rc = kvm_curve_read_key(public_file, pub)) ||
        (rc = kvm_curve_read_secret_key(secret_file, sec)))
        return rc;
    /* a public key that is not the secret key's half (two pairs mixed up) failed every
     * handshake without a word: ask blamed the server's key, decode workers never joined */
    if ((rc = kvm_curve_check_client_pair(secret_file, public_file))) return rc;
    if (zmq_setsockopt(sock, ZMQ_CURVE_SERVERKEY, srv, 40) || zmq_setsockopt(sock, ZMQ_CURVE_PUBLICKEY, pub, 40) ||
        zmq_setsockopt(sock, ZMQ_CURVE_SECRETKEY, sec, 40))
        return kvm_err(KVM_EIO, "CurveZMQ client setup: %s", zmq_strerror(errno));
    return 0;
}

/* ---- ZAP handler (RFC 27): one per process, for one ZeroMQ context at a time ---- */

static pthread_mutex_t zap_mu = PTHREAD_MUTEX_INITIALIZER;
static void *zap_ctx;      /* the context the handler serves; NULL when none runs */
static pthread_t zap_th;   /* its thread: joined by kvm_curve_ctx_term, never detached */
static char zap_dir[4096]; /* the authorized_keys folder it checks */

/* 1 when a *.public file in zap_dir holds the Z85 form of this 32-byte key. */
static int key_in_dir(const char *dir, const char *z85);

static int key_authorized(const uint8_t *key32)
{
    char z85[41];
    if (!zmq_z85_encode(z85, key32, 32)) return 0;
    return key_in_dir(zap_dir, z85);
}

int kvm_curve_check_authorized(const char *public_file, const char *authorized_dir)
{
    char pub[41];
    int rc = kvm_curve_read_key(public_file, pub);
    if (rc) return rc;
    if (!key_in_dir(authorized_dir, pub))
        return kvm_err(KVM_EMISMATCH, "%s is not in authorized_keys %s: copy it there (a key is authorized by a "
                                      "*.public file holding it)",
                       public_file, authorized_dir);
    return 0;
}

/* 1 when a *.public file in dir holds the Z85 key z85. */
static int key_in_dir(const char *dir, const char *z85)
{
    DIR *d = opendir(dir);
    if (!d) return 0;
    struct dirent *e;
    int ok = 0;
    while (!ok && (e = readdir(d))) {
        size_t l = strlen(e->d_name);
        if (l < 8 || strcmp(e->d_name + l - 7, ".public")) continue;
        char path[8192], k[41];
        snprintf(path, sizeof path, "%s/%s", dir, e->d_name);
        ok = kvm_curve_read_key(path, k) == 0 && !strcmp(k, z85);
    }
    closedir(d);
    return ok;
}

/* The *.public files in dir that do not read as a key (garbage, a dangling link, unreadable):
 * such a file was skipped without a word, and the client whose key it was to hold only heard
 * that its key was refused. With warn each is logged (8 named, then a count); *first (cap bytes,
 * may be NULL) gets the first one's reason. Returns how many. */
static int64_t unreadable_keys(const char *dir, int warn, char *first, size_t cap)
{
    DIR *d = opendir(dir);
    if (first && cap) first[0] = '\0';
    if (!d) return 0;
    int64_t n = 0;
    for (struct dirent *e; (e = readdir(d));) {
        size_t l = strlen(e->d_name);
        if (l < 8 || strcmp(e->d_name + l - 7, ".public")) continue;
        char path[8192], k[41];
        snprintf(path, sizeof path, "%s/%s", dir, e->d_name);
        if (kvm_curve_read_key(path, k) == 0) continue;
        if (++n == 1 && first && cap) snprintf(first, cap, "%s", kvm_errmsg());
        if (warn && n <= 8) {
            kvm_log_field f[] = {KVM_LOG_S("file", path), KVM_LOG_S("reason", kvm_errmsg())};
            kvm_log(KVM_LOG_WARN, "key_unreadable", f, 2,
                    "authorized_keys: %s: skipped, the client whose key it is will be refused", kvm_errmsg());
        }
    }
    closedir(d);
    if (warn && n > 8)
        kvm_log(KVM_LOG_WARN, "key_unreadable", NULL, 0, "authorized_keys %s: %lld more .public files skipped", dir,
                (long long)(n - 8));
    return n;
}

/* Logs a refused client key once (the handler's thread alone calls it): only the client was
 * told (a worker exits naming its key), and the operator of the run, serve or store service saw
 * nothing of who knocked. The first 16 keys are named; past them, a peer cycling through
 * throwaway keys would fill the log, so the others are counted and said at most once a minute.
 * addr: the peer's address as ZAP gives it. */
static void say_refused(const void *key, zmq_msg_t *addr)
{
    static uint8_t said[16][32];
    static int n_said;
    static int64_t unnamed;
    static time_t unnamed_said;
    for (int i = 0; i < n_said; i++)
        if (!memcmp(said[i], key, 32)) return;
    if (n_said == 16) {
        unnamed++;
        time_t now = time(NULL);
        if (now - unnamed_said < 60) return;
        kvm_log(KVM_LOG_WARN, "key_refused", NULL, 0,
                "refused %lld more CurveZMQ client keys not in [security] authorized_keys (past the 16 named; "
                "said at most once a minute)",
                (long long)unnamed);
        unnamed = 0;
        unnamed_said = now;
        return;
    }
    memcpy(said[n_said++], key, 32);
    char z85[41] = "", peer[64];
    if (!zmq_z85_encode(z85, key, 32)) z85[0] = '\0';
    snprintf(peer, sizeof peer, "%.*s", (int)(zmq_msg_size(addr) < 63 ? zmq_msg_size(addr) : 63),
             (const char *)zmq_msg_data(addr));
    char bad[600], hint[800] = "";
    int64_t n_bad = unreadable_keys(zap_dir, 0, bad, sizeof bad);
    if (n_bad)
        snprintf(hint, sizeof hint, "; %lld .public file%s there could not be read, e.g. %s", (long long)n_bad,
                 n_bad == 1 ? "" : "s", bad);
    kvm_log_field f[] = {KVM_LOG_S("client_key", z85), KVM_LOG_S("peer", peer)};
    kvm_log(KVM_LOG_WARN, "key_refused", f, 2,
            "refused a CurveZMQ client key %s from %s: not in [security] authorized_keys (add its .public file "
            "there to let it in)%s",
            z85, *peer ? peer : "an unknown address", hint);
}

static void *zap_thread(void *sock)
{
    for (;;) {
        zmq_msg_t part[8];
        int n = 0, more = 1;
        while (more && n < 8) {
            zmq_msg_init(&part[n]);
            int got;
            while ((got = zmq_msg_recv(&part[n], sock, 0)) < 0 && errno == EINTR) {}
            if (got < 0) {
                for (int i = 0; i <= n; i++) zmq_msg_close(&part[i]);
                zmq_close(sock); /* lets zmq_ctx_term end; kvm_curve_ctx_term then joins this thread */
                return NULL;     /* context terminated */
            }
            more = zmq_msg_more(&part[n]);
            n++;
        }
        /* version, request id, domain, address, identity, mechanism, credentials... */
        int ok = n >= 7 && zmq_msg_size(&part[5]) == 5 && !memcmp(zmq_msg_data(&part[5]), "CURVE", 5) &&
                 zmq_msg_size(&part[6]) == 32 && key_authorized(zmq_msg_data(&part[6]));
        if (!ok && n >= 7 && zmq_msg_size(&part[6]) == 32) say_refused(zmq_msg_data(&part[6]), &part[3]);
        const char *code = ok ? "200" : "400", *text = ok ? "OK" : "unknown client key";
        /* the user id (a message's "User-Id" property on the server) is the client's key in Z85 */
        char user[41] = "";
        if (ok && !zmq_z85_encode(user, zmq_msg_data(&part[6]), 32)) user[0] = '\0';
        zmq_send(sock, "1.0", 3, ZMQ_SNDMORE);
        zmq_send(sock, n > 1 ? zmq_msg_data(&part[1]) : "", n > 1 ? zmq_msg_size(&part[1]) : 0, ZMQ_SNDMORE);
        zmq_send(sock, code, 3, ZMQ_SNDMORE);
        zmq_send(sock, text, strlen(text), ZMQ_SNDMORE);
        zmq_send(sock, user, strlen(user), ZMQ_SNDMORE);
        zmq_send(sock, "", 0, 0);
        for (int i = 0; i < n; i++) zmq_msg_close(&part[i]);
    }
}

/* Starts the handler for zctx (zap_mu held). Its thread blocks every signal, as libzmq's own
 * threads do, so a SIGINT or SIGTERM meant for the process's handler is not taken there, and
 * it is joinable: a detached handler could still be running when `kvmill serve` returned from
 * main, a thread LeakSanitizer's exit check had to stop too. */
static int zap_start(void *zctx, const char *authorized_dir)
{
    snprintf(zap_dir, sizeof zap_dir, "%s", authorized_dir);
    unreadable_keys(authorized_dir, 1, NULL, 0);
    void *zap = zmq_socket(zctx, ZMQ_REP);
    if (!zap || zmq_bind(zap, "inproc://zeromq.zap.01")) {
        int e = errno;
        if (zap) zmq_close(zap); /* left open, it would keep zmq_ctx_term waiting forever */
        return kvm_err(KVM_EIO, "cannot start the ZAP handler: %s", zmq_strerror(e));
    }
    sigset_t all, old;
    sigfillset(&all);
    pthread_sigmask(SIG_BLOCK, &all, &old);
    int e = pthread_create(&zap_th, NULL, zap_thread, zap);
    pthread_sigmask(SIG_SETMASK, &old, NULL);
    if (e) {
        zmq_close(zap);
        return kvm_err(KVM_EIO, "cannot start the ZAP handler thread: %s", strerror(e));
    }
    zap_ctx = zctx;
    return 0;
}

int kvm_curve_server(void *zctx, void *sock, const char *secret_file, const char *authorized_dir)
{
    char sec[41];
    int rc = kvm_curve_read_secret_key(secret_file, sec);
    if (rc) return rc;
    struct stat st;
    if (!authorized_dir || stat(authorized_dir, &st))
        return kvm_err(KVM_ENOTFOUND, "authorized_keys folder %s does not exist", authorized_dir ? authorized_dir : "(unset)");
    if (!S_ISDIR(st.st_mode))
        return kvm_err(KVM_EFORMAT, "authorized_keys %s is not a folder (it holds the clients' .public files)",
                       authorized_dir);
    pthread_mutex_lock(&zap_mu);
    if (!zap_ctx)
        rc = zap_start(zctx, authorized_dir);
    else if (zap_ctx != zctx)
        rc = kvm_err(KVM_ESTATE, "the ZAP handler serves another ZeroMQ context: end it with kvm_curve_ctx_term first");
    pthread_mutex_unlock(&zap_mu);
    if (rc) return rc;
    int one = 1;
    if (zmq_setsockopt(sock, ZMQ_CURVE_SERVER, &one, sizeof one) || zmq_setsockopt(sock, ZMQ_CURVE_SECRETKEY, sec, 40))
        return kvm_err(KVM_EIO, "CurveZMQ server setup: %s", zmq_strerror(errno));
    return 0;
}

int kvm_curve_ctx_term(void *zctx)
{
    if (!zctx) return 0;
    int rc;
    while ((rc = zmq_ctx_term(zctx)) != 0 && errno == EINTR) {} /* a signal: its threads still run */
    pthread_mutex_lock(&zap_mu);
    int served = zap_ctx == zctx;
    pthread_t th = zap_th;
    if (served) zap_ctx = NULL;
    pthread_mutex_unlock(&zap_mu);
    if (served) pthread_join(th, NULL); /* it closed its socket, which zmq_ctx_term waited for */
    return rc ? kvm_err(KVM_EIO, "zmq_ctx_term: %s", zmq_strerror(errno)) : 0;
}
