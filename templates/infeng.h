/* infeng.h: the C ABI of a compiled infeng model library (libmodel.so).
 *
 * Versioned: a runtime refuses a library whose ife_abi_version() differs from the one it knows.
 * The caller owns scheduling: it hands out KV block ids (block tables) and sequence slots; the
 * library owns the KV block pool and the thread pool. Every int function returns 0 on success.
 * Lines starting with '#' are dropped before this header is fed to cffi, so keep declarations plain.
 */
#ifndef INFENG_H
#define INFENG_H
#include <stdint.h>

#define INFENG_ABI_VERSION 1

typedef struct ife_model ife_model;

int ife_abi_version(void);
const char *ife_target_name(void);

/* 0 when this CPU has every feature the library was compiled for; else writes the missing
 * feature names (/proc/cpuinfo spelling, comma-separated) into missing. Safe on any x86-64 CPU. */
int ife_cpu_check(char *missing, int len);

/* Static facts of the compiled model. */
int ife_max_tokens(void);      /* most token rows one ife_forward call takes */
int ife_block_size(void);      /* tokens per KV block */
int ife_vocab_size(void);
int64_t ife_weights_bytes(void);
int64_t ife_kv_block_bytes(void); /* bytes one KV block takes over all layers */
/* 1: ife_create reserves the KV pool's address space and memory is committed page by page as KV
 * rows are first written (a block id not handed out costs nothing). Libraries without it (compiled
 * before) commit the whole pool in ife_create. */
int ife_kv_on_demand(void);

/* Maps weights_path (weights.bin) read-only, reserves n_kv_blocks KV blocks and allocates an
 * activation arena. n_threads <= 0 means one per physical core. On failure returns NULL and writes
 * why to err. */
ife_model *ife_create(const char *weights_path, int n_kv_blocks, int n_threads, char *err, int err_len);

/* One forward step over n_tokens rows from any number of sequences.
 *   tokens, positions, seq_slots: [n_tokens]
 *   block_table: [n_slots, max_blocks]; the KV block of position p of slot s is
 *                block_table[s * max_blocks + p / ife_block_size()]
 *   logits_rows: [n_logits] rows whose logits are written to logits: [n_logits, vocab]
 * Rows of one sequence must appear in increasing position order. */
int ife_forward(ife_model *m, int n_tokens, const int32_t *tokens, const int32_t *positions,
                const int32_t *seq_slots, const int32_t *block_table, int max_blocks,
                int n_logits, const int32_t *logits_rows, float *logits, const int32_t *adapter_slots);

/* The runtime freed sequence slot `slot` (the next sequence in it is another one): forget the
 * per-slot state the library keeps (the f16 window ring's). A library without it (compiled before)
 * treats every step that does not continue a slot's last position as a new sequence. */
void ife_slot_free(ife_model *m, int slot);
/* Copy KV block `block` of the pool out to buf (ife_kv_block_read) or from buf into the pool
 * (ife_kv_block_write): ife_kv_block_bytes() bytes, every layer's K then V part in layer order, in
 * the library's own KV format. Persists the prefix cache across restarts (prefix_store.py).
 * Returns nonzero for a block out of range. A library without them (compiled before) cannot. */
int ife_kv_block_read(const ife_model *m, int block, void *buf);
int ife_kv_block_write(ife_model *m, int block, const void *buf);

/* LoRA slots (a library compiled with lora-slots; else ife_lora_sites() is 0). adapter_slots of
 * ife_forward: [n_tokens], the slot of each token, -1 for the base model; NULL for all -1.
 * ife_lora_set copies one site's matrices into a slot: a [rank, in], b [out, rank] (PEFT's
 * lora_A / lora_B), scale = alpha / r; rank 0 clears it. Returns nonzero on a bad argument. */
int ife_lora_sites(void);
int ife_lora_slots(void);
int ife_lora_max_rank(void);
int ife_lora_set(ife_model *m, int slot, int site, int rank, float scale, const float *a, const float *b);

int ife_threads(const ife_model *m);

/* Per-node profile of a library compiled with --profile (entries in IR node order; the manifest's
 * "profile" list names them). ife_profile_entries() is 0 in a normal build, which times nothing.
 * ns/calls accumulate since create or the last reset; last_begin/last_end are the span of each
 * node in the latest step (monotonic ns, 0 when it did not run). Each array has entries slots. */
int ife_profile_entries(void);
void ife_profile_read(const ife_model *m, int64_t *ns, int64_t *calls, int64_t *last_begin, int64_t *last_end);
void ife_profile_reset(ife_model *m);
void ife_destroy(ife_model *m);

#endif
