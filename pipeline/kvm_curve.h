/* kvm_curve.h: CurveZMQ (ZeroMQ's built-in encryption and authentication) for sockets that
 * leave the machine. Keys are Z85 text files of 40 characters (kvmill keygen); the server
 * accepts only clients whose public key is a file in its authorized_keys folder, checked by
 * a ZAP handler (RFC 27) running in the process. Local endpoints (ipc://, tcp://127.x) may
 * run without keys. */
#ifndef KVM_CURVE_H
#define KVM_CURVE_H

/* Writes a new key pair: PREFIX.public and PREFIX.secret (mode 0600). Returns 0, KVM_EIO
 * (file), KVM_ENOTSUP (libzmq without CURVE). */
int kvm_curve_keygen(const char *prefix);

/* Reads a 40-character Z85 key from a file into key[41] (a symbolic link is followed). Errors:
 * KVM_ENOTFOUND, KVM_EIO (a directory: "Is a directory"), KVM_EFORMAT (not a Z85 key, or not a
 * regular file: a FIFO is refused, not waited on; names the file). */
int kvm_curve_read_key(const char *path, char key[41]);

/* read_key for a secret key file (server_secret_key, a client's secret key), which is also
 * checked as ssh checks a private key, on the file a symbolic link leads to: one that other
 * users may read (or only its group write) is used, with one warning per file and mode per
 * process (kvm_log, event key_file_mode) naming the file, its mode in octal and `chmod 600
 * FILE`; one that every user may write is refused with KVM_EINVAL (same message). Errors as
 * read_key, and that KVM_EINVAL. Thread-safe. */
int kvm_curve_read_secret_key(const char *path, char key[41]);

/* The name of a filesystem that often keeps no Unix permissions of its own (FAT, exFAT, NTFS,
 * FUSE, SMB/CIFS, 9p: the modes a stat shows may be the mount's, and chmod may leave them as they
 * are; a FUSE or CIFS mount with Unix extensions, or WSL's drvfs with `metadata`, keeps them),
 * from statfs's f_type; NULL for any other. On one of these the secret key check (above) adds,
 * after `chmod 600`, to copy the key to a Linux filesystem if the mode stays. Pure; thread-safe. */
const char *kvm_curve__modeless_fs(long f_type);

/* Checks that public_file holds the public key of the secret key in secret_file (a swapped or
 * stale pair would make every client fail its handshake silently). Returns 0, KVM_EMISMATCH
 * (naming both files), or read_key's and read_secret_key's errors. */
int kvm_curve_check_pair(const char *secret_file, const char *public_file);

/* The same check for a client's pair (--client-public / --client-secret, [security]
 * client_public_key / client_secret_key): KVM_EMISMATCH names both files. */
int kvm_curve_check_client_pair(const char *secret_file, const char *public_file);

/* Checks that the key in public_file is authorized: a *.public file in authorized_dir holds it
 * (what the ZAP handler checks at each handshake). Returns 0, KVM_EMISMATCH (naming both), or
 * read_key's errors. */
int kvm_curve_check_authorized(const char *public_file, const char *authorized_dir);

/* 1 when `endpoint` (bound, or connected to) keeps traffic on this machine: ipc://, inproc://,
 * and a tcp:// loopback address however spelled (kvm_jobcfg_is_loopback: 127.0.0.0/8, [::1],
 * localhost in any case; not an interface name), else 0. */
int kvm_curve_is_local(const char *endpoint);

/* Makes `sock` a CURVE client of the server whose public key is in server_key_file, with
 * this side's key pair. All three NULL: plain socket (returns 0). Errors as read_key and read_secret_key,
 * KVM_EINVAL (only some given), KVM_EMISMATCH (public_file is not secret_file's half). */
int kvm_curve_client(void *sock, const char *server_key_file, const char *public_file, const char *secret_file);

/* Makes `sock` a CURVE server with the secret key in secret_file; clients are authorised
 * against the *.public files in authorized_dir by the process's ZAP handler (a thread started
 * on first use in zmq context zctx, with authorized_dir as then given; one context at a time),
 * which gives each accepted connection the client's public key in Z85 as its user id
 * (kvm_msg_user_id of what it sends). The context must be ended with kvm_curve_ctx_term, which
 * joins the handler. Errors as read_secret_key, KVM_ENOTFOUND (no authorized_dir), KVM_EFORMAT
 * (authorized_dir is not a folder), KVM_ESTATE (the handler serves another context not yet
 * ended), KVM_EIO. */
int kvm_curve_server(void *zctx, void *sock, const char *secret_file, const char *authorized_dir);

/* Ends zmq context zctx as zmq_ctx_term does (its sockets must be closed), restarting it when
 * a signal interrupts it (EINTR would leave its I/O threads running), then joins the ZAP
 * handler kvm_curve_server started for it, if any: when it returns no thread of the context
 * runs, and a later context can start a handler of its own. NULL: nothing. Returns 0, or
 * KVM_EIO (zctx not a context). */
int kvm_curve_ctx_term(void *zctx);

#endif
