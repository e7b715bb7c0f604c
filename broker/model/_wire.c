/* broker.model._wire: the native reader of IntentBatch wire bytes (kvbroker.v1).
 *
 * Why: reading a batch through the protobuf runtime costs more than applying it. Every
 * field read builds a wrapper, and every block id named by an access is a new Python
 * string (about 180 ns per id, measured: a third of a decode-mode replay). This reader walks the
 * serialized batch (the bytes the broker already holds: it journals batches as received)
 * and yields one plain tuple per event, the layout broker/model/wire.py documents.
 * broker/model/wire.py also holds the reference reader, over the protobuf runtime, which
 * yields the same tuples; tests/broker/model/test_wire.py holds the two equal.
 *
 * It takes a strict subset of the encodings protobuf allows, and refuses everything else
 * with Unsupported before any event is read, so the caller can fall back to the
 * reference reader, which defines the meaning (merged repeats of a message field, a
 * scalar given twice, a field with an unexpected wire type, groups, invalid UTF-8 which
 * the protobuf runtime rejects). Canonical encoders (every protobuf library) never
 * produce those, so in practice every batch takes this path.
 *
 * Events are decoded lazily, one per iteration step: block ids are looked up in the
 * core's block dict when the event is read, after the batch's earlier events were applied
 * (a batch may allocate a block and then access it, or free one and allocate it again).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>
#include <stdint.h>
#include <string.h>

static PyObject *Unsupported; /* ValueError subclass: use the reference reader */

/* ---- field tables ---------------------------------------------------------------------- */

/* F_PACKED: a repeated varint field in packed form (one length-delimited run of varints). */
enum { F_NONE = 0, F_VARINT, F_STR, F_RSTR, F_MSG, F_PACKED };

#define MAX_FIELD 24

typedef struct msgdef {
    int max;      /* highest field number described */
    int oneof_lo; /* fields oneof_lo..oneof_hi form one oneof (0: none) */
    int oneof_hi;
    uint8_t type[MAX_FIELD + 1];
    const struct msgdef *sub[MAX_FIELD + 1];
} msgdef;

static const msgdef M_INTENT = {
    24, 0, 0,
    /* 1 block_id, 2 request_id, 3 phase, 4 priority, 5 deadline_us, 6 slack_us,
       7 recompute_cost_us, 8 spill_cost_us, 9 size_bytes, 10 pin_requested, 11 is_draft,
       12 is_committed, 13 tenant, 14 layer, 15 head_group, 16 token_start, 17 token_count,
       18 allowed_tiers (repeated), 19 parent_block_id, 20 request_priority,
       21 expected_reuse_window_tokens, 22 recompute_ok, 23 compression_ok, 24 prefetch_ok */
    {F_NONE, F_STR, F_STR, F_VARINT, F_VARINT, F_VARINT, F_VARINT, F_VARINT, F_VARINT, F_VARINT, F_VARINT, F_VARINT, F_VARINT,
     F_STR, F_VARINT, F_VARINT, F_VARINT, F_VARINT, F_RSTR, F_STR, F_VARINT, F_VARINT, F_VARINT, F_VARINT, F_VARINT},
    {0},
};
/* BlockAllocated: 1 intent, 2 tier, 3 reuse, 4 scope */
static const msgdef M_ALLOCATED = {4, 0, 0, {F_NONE, F_MSG, F_STR, F_VARINT, F_STR}, {NULL, &M_INTENT, NULL, NULL, NULL}};
/* BlocksAccessed: 1 block_ids (repeated), 2 next_use_us, 3 scope, 4 token_positions (packed;
 * the unpacked form, which protobuf also reads, is refused: the reference reader reads it),
 * 5 ends_scope, 6 refresh_only */
static const msgdef M_ACCESSED = {6, 0, 0, {F_NONE, F_RSTR, F_VARINT, F_STR, F_PACKED, F_STR, F_VARINT}, {0}};
static const msgdef M_UPDATED = {
    12, 0, 0,
    /* 1 block_id, 2 phase, 3 priority, 4 deadline_us, 5 slack_us, 6 pin_requested,
       7 is_committed, 8 is_draft, 9 recompute_cost_us, 10 clear_deadline,
       11 expected_reuse_window_tokens, 12 request_priority */
    {F_NONE, F_STR, F_VARINT, F_VARINT, F_VARINT, F_VARINT, F_VARINT, F_VARINT, F_VARINT, F_VARINT, F_VARINT, F_VARINT, F_VARINT},
    {0},
};
static const msgdef M_IDS = {1, 0, 0, {F_NONE, F_RSTR}, {0}}; /* BlocksReleased, BlocksFreed */
static const msgdef M_EMPTY = {0, 0, 0, {F_NONE}, {0}};        /* AllBlocksCleared */
static const msgdef M_ACKED = {4, 0, 0, {F_NONE, F_VARINT, F_VARINT, F_STR, F_STR}, {0}};
/* EvictionRequested: 1 tier, 2 count, 3 protected_block_ids (repeated) */
static const msgdef M_EVICTION = {3, 0, 0, {F_NONE, F_STR, F_VARINT, F_RSTR}, {0}};
static const msgdef M_EVENT = {
    9, 2, 9,
    /* 1 ts_us; oneof kind: 2 allocated, 3 accessed, 4 intent_updated, 5 released,
       6 freed, 7 cleared, 8 acked, 9 eviction_requested */
    {F_NONE, F_VARINT, F_MSG, F_MSG, F_MSG, F_MSG, F_MSG, F_MSG, F_MSG, F_MSG},
    {NULL, NULL, &M_ALLOCATED, &M_ACCESSED, &M_UPDATED, &M_IDS, &M_IDS, &M_EMPTY, &M_ACKED, &M_EVICTION},
};
/* IntentBatch: 1 client_id, 2 batch_seq, 3 events (repeated, scanned by the caller), 4 tenant,
 * 5 broker_received_us */
static const msgdef M_BATCH = {5, 0, 0, {F_NONE, F_STR, F_VARINT, F_NONE, F_STR, F_VARINT}, {0}};

/* ---- wire primitives -------------------------------------------------------------------- */

/* A varint of at most 10 bytes whose value fits 64 bits; 0 on success. */
static inline int read_varint(const uint8_t **pp, const uint8_t *end, uint64_t *out) {
    const uint8_t *p = *pp;
    uint64_t v = 0;
    for (int i = 0; i < 10; i++) {
        if (p >= end) return -1;
        uint8_t b = *p++;
        if (i == 9 && b > 1) return -1; /* bits beyond 64, or an 11th byte */
        v |= (uint64_t)(b & 0x7F) << (7 * i);
        if (b < 0x80) {
            *pp = p;
            *out = v;
            return 0;
        }
    }
    return -1;
}

/* A length prefix that stays inside the buffer. Like a key, it is a 32-bit varint of at
 * most 5 bytes, below 2^31 - 1: protobuf (upb) rejects a longer encoding as malformed, even
 * of a small value (found by atheris). */
static inline int read_len(const uint8_t **pp, const uint8_t *end, Py_ssize_t *out) {
    uint64_t n;
    const uint8_t *start = *pp;
    if (read_varint(pp, end, &n)) return -1;
    if (*pp - start > 5 || n >= INT32_MAX || n > (uint64_t)(end - *pp)) return -1;
    *out = (Py_ssize_t)n;
    return 0;
}

/* Well-formed UTF-8 as protobuf and Python's strict decoder define it: no overlong forms,
 * no surrogates, nothing above U+10FFFF. ASCII runs are checked eight bytes at a time. */
static int utf8_ok(const uint8_t *s, Py_ssize_t n) {
    const uint8_t *e = s + n;
    while (s < e) {
        while (e - s >= 8) {
            uint64_t w;
            memcpy(&w, s, 8);
            if (w & 0x8080808080808080ULL) break;
            s += 8;
        }
        if (s >= e) break;
        uint8_t c = *s;
        if (c < 0x80) {
            s++;
        } else if (c < 0xC2) {
            return 0;
        } else if (c < 0xE0) {
            if (e - s < 2 || (s[1] & 0xC0) != 0x80) return 0;
            s += 2;
        } else if (c < 0xF0) {
            if (e - s < 3 || (s[1] & 0xC0) != 0x80 || (s[2] & 0xC0) != 0x80) return 0;
            if ((c == 0xE0 && s[1] < 0xA0) || (c == 0xED && s[1] > 0x9F)) return 0;
            s += 3;
        } else if (c < 0xF5) {
            if (e - s < 4 || (s[1] & 0xC0) != 0x80 || (s[2] & 0xC0) != 0x80 || (s[3] & 0xC0) != 0x80) return 0;
            if ((c == 0xF0 && s[1] < 0x90) || (c == 0xF4 && s[1] > 0x8F)) return 0;
            s += 4;
        } else {
            return 0;
        }
    }
    return 1;
}

/* Step over one field this reader does not know (its value only). */
static int skip_value(int wire, const uint8_t **pp, const uint8_t *end) {
    uint64_t v;
    Py_ssize_t n;
    switch (wire) {
        case 0:
            return read_varint(pp, end, &v);
        case 1:
            if (end - *pp < 8) return -1;
            *pp += 8;
            return 0;
        case 2:
            if (read_len(pp, end, &n)) return -1;
            *pp += n;
            return 0;
        case 5:
            if (end - *pp < 4) return -1;
            *pp += 4;
            return 0;
        default: /* groups (3, 4) and the reserved 6, 7 */
            return -1;
    }
}

/* One field's key: its number (1..2^29-1) and wire type. A key is a 32-bit varint of at
 * most 5 bytes: protobuf (upb) rejects a longer one as malformed, even when its value is
 * small (an overlong encoding), so this reader must not take it either. (A value's varint
 * may take all 10 bytes.) */
static inline int read_key(const uint8_t **pp, const uint8_t *end, uint32_t *number, int *wire) {
    uint64_t key;
    const uint8_t *start = *pp;
    if (read_varint(pp, end, &key)) return -1;
    if (*pp - start > 5 || key > UINT32_MAX) {
        *pp = start;
        return -1;
    }
    uint64_t num = key >> 3;
    if (num == 0 || num > 0x1FFFFFFF) return -1;
    *number = (uint32_t)num;
    *wire = (int)(key & 7);
    return 0;
}

/* ---- the validating scan ---------------------------------------------------------------- */

/* Check a whole message against its table; 0 if this reader takes it. Unknown fields are
 * stepped over (protobuf keeps them aside; they mean nothing to the broker). */
static int scan_msg(const msgdef *m, const uint8_t *p, const uint8_t *end) {
    uint32_t seen = 0;
    int oneof_seen = 0;
    while (p < end) {
        uint32_t num;
        int wire;
        if (read_key(&p, end, &num, &wire)) return -1;
        int type = num <= (uint32_t)m->max ? m->type[num] : F_NONE;
        if (type == F_NONE) {
            if (skip_value(wire, &p, end)) return -1;
            continue;
        }
        if (type != F_RSTR) {
            if (seen & (1u << num)) return -1; /* given twice: protobuf merges or overwrites */
            seen |= 1u << num;
        }
        if (m->oneof_lo && (int)num >= m->oneof_lo && (int)num <= m->oneof_hi) {
            if (oneof_seen) return -1; /* two members of the oneof: the last one wins there */
            oneof_seen = 1;
        }
        if (type == F_VARINT) {
            uint64_t v;
            if (wire != 0 || read_varint(&p, end, &v)) return -1;
        } else {
            Py_ssize_t n;
            if (wire != 2 || read_len(&p, end, &n)) return -1;
            if (type == F_MSG) {
                if (scan_msg(m->sub[num], p, p + n)) return -1;
            } else if (type == F_PACKED) {
                const uint8_t *q = p;
                uint64_t v;
                while (q < p + n) {
                    if (read_varint(&q, p + n, &v)) return -1;
                }
            } else if (!utf8_ok(p, n)) {
                return -1;
            }
            p += n;
        }
    }
    return 0;
}

/* ---- decoding one message into slots ------------------------------------------------------ */

typedef struct {
    uint8_t present;
    uint64_t v;          /* F_VARINT */
    const uint8_t *s;    /* F_STR, F_MSG: the value; F_RSTR: the first occurrence */
    Py_ssize_t n;        /* its length; F_RSTR: the number of occurrences */
} slot_t;

/* Fill one slot per described field of an already scanned message. */
static void fill(const msgdef *m, const uint8_t *p, const uint8_t *end, slot_t *slots) {
    memset(slots, 0, sizeof(slot_t) * (size_t)(m->max + 1));
    while (p < end) {
        uint32_t num;
        int wire;
        if (read_key(&p, end, &num, &wire)) return; /* not reached: scanned */
        int type = num <= (uint32_t)m->max ? m->type[num] : F_NONE;
        if (type == F_NONE) {
            if (skip_value(wire, &p, end)) return;
            continue;
        }
        slot_t *slot = &slots[num];
        if (type == F_VARINT) {
            if (read_varint(&p, end, &slot->v)) return;
            slot->present = 1;
            continue;
        }
        Py_ssize_t n;
        if (read_len(&p, end, &n)) return;
        if (type == F_RSTR) {
            if (!slot->present) slot->s = p;
            slot->n++;
        } else {
            slot->s = p;
            slot->n = n;
        }
        slot->present = 1;
        p += n;
    }
}

/* ---- values ------------------------------------------------------------------------------ */

/* Block ids come back batch after batch (a decode step names every block of its request).
 * A fresh str per id cost a decode, a siphash for the dict lookup and a free, several
 * hundred instructions an id; this cache hands back the str already made for the same bytes
 * (usually the core's own dict key, so the lookup finds it by identity, its hash cached).
 * Direct-mapped by a cheap hash of the bytes, bounded: at most ID_CACHE_SIZE short ASCII
 * strings stay alive through it. A str is immutable, so any equal one is as good: the cache
 * changes no result, only what it costs. */
#define ID_CACHE_BITS 16
#define ID_CACHE_SIZE (1 << ID_CACHE_BITS)
#define ID_CACHE_MAX_LEN 128
static PyObject *id_cache[ID_CACHE_SIZE];

static inline uint64_t id_hash(const uint8_t *p, Py_ssize_t n) {
    uint64_t h = 0x9E3779B97F4A7C15ULL ^ (uint64_t)n;
    while (n >= 8) {
        uint64_t w;
        memcpy(&w, p, 8);
        h = (h ^ w) * 0xFF51AFD7ED558CCDULL;
        h ^= h >> 32;
        p += 8;
        n -= 8;
    }
    uint64_t w = 0;
    memcpy(&w, p, (size_t)n);
    h = (h ^ w) * 0xC4CEB9FE1A85EC53ULL;
    return h ^ (h >> 29);
}

/* A str of the (validated) UTF-8 bytes of a block id. */
static PyObject *id_str(const uint8_t *p, Py_ssize_t n) {
    if (n == 0 || n > ID_CACHE_MAX_LEN) return PyUnicode_DecodeUTF8((const char *)p, n, NULL);
    PyObject **slot = &id_cache[id_hash(p, n) >> (64 - ID_CACHE_BITS)];
    PyObject *cached = *slot;
    if (cached != NULL && PyUnicode_GET_LENGTH(cached) == n && memcmp(PyUnicode_DATA(cached), p, (size_t)n) == 0) {
        return Py_NewRef(cached); /* only compact ASCII strings are cached: one byte per character */
    }
    PyObject *fresh = PyUnicode_DecodeUTF8((const char *)p, n, NULL);
    if (fresh != NULL && PyUnicode_IS_COMPACT_ASCII(fresh)) Py_XSETREF(*slot, Py_NewRef(fresh));
    return fresh;
}

static inline PyObject *id_of(const slot_t *slot) {
    if (!slot->present || slot->n == 0) return PyUnicode_FromStringAndSize(NULL, 0);
    return id_str(slot->s, slot->n);
}

static inline PyObject *str_of(const slot_t *slot) {
    if (!slot->present || slot->n == 0) return PyUnicode_FromStringAndSize(NULL, 0);
    return PyUnicode_DecodeUTF8((const char *)slot->s, slot->n, NULL);
}

static inline PyObject *bool_of(const slot_t *slot) { return PyBool_FromLong(slot->present && slot->v != 0); }

/* int64 (two's complement on the wire) */
static inline PyObject *i64_of(const slot_t *slot) { return PyLong_FromLongLong(slot->present ? (long long)(int64_t)slot->v : 0); }
static inline PyObject *u64_of(const slot_t *slot) { return PyLong_FromUnsignedLongLong(slot->present ? slot->v : 0); }
/* uint32: protobuf keeps the low 32 bits of a longer varint */
static inline PyObject *u32_of(const slot_t *slot) { return PyLong_FromUnsignedLong(slot->present ? (uint32_t)slot->v : 0); }
/* enums are int32 on the wire, and proto3 keeps unknown values */
static inline PyObject *enum_of(const slot_t *slot) { return PyLong_FromLong(slot->present ? (long)(int32_t)slot->v : 0); }

static inline PyObject *opt(PyObject *(*conv)(const slot_t *), const slot_t *slot) {
    if (!slot->present) Py_RETURN_NONE;
    return conv(slot);
}

/* Walk a scanned message and collect the values of repeated string field ``field`` as new
 * str objects into ``out``, a list (or, with ``as_tuple``, a tuple) of exactly that many
 * items. */
static int collect_strings(const uint8_t *p, const uint8_t *end, uint32_t field, PyObject *out, int as_tuple) {
    Py_ssize_t i = 0;
    while (p < end) {
        uint32_t num;
        int wire;
        if (read_key(&p, end, &num, &wire)) return -1;
        if (num != field) {
            if (skip_value(wire, &p, end)) return -1;
            continue;
        }
        Py_ssize_t n;
        if (read_len(&p, end, &n)) return -1;
        PyObject *s = id_str(p, n);
        if (s == NULL) return -1;
        if (as_tuple) {
            PyTuple_SET_ITEM(out, i++, s);
        } else {
            PyList_SET_ITEM(out, i++, s);
        }
        p += n;
    }
    return 0;
}

/* A tuple of ``n`` new references (stolen); if any is NULL (an error is set), none leaks. */
static PyObject *pack(Py_ssize_t n, PyObject **items) {
    for (Py_ssize_t i = 0; i < n; i++) {
        if (items[i] == NULL) {
            for (Py_ssize_t j = 0; j < n; j++) Py_XDECREF(items[j]);
            return NULL;
        }
    }
    PyObject *t = PyTuple_New(n);
    if (t == NULL) {
        for (Py_ssize_t j = 0; j < n; j++) Py_DECREF(items[j]);
        return NULL;
    }
    for (Py_ssize_t i = 0; i < n; i++) PyTuple_SET_ITEM(t, i, items[i]);
    return t;
}

/* The blocks a message names (repeated string ``field``, ``count`` values), looked up in
 * ``blocks`` now. All found (and at least one): *found is the list of blocks, *ids None.
 * Otherwise *found is None and *ids the list of ids, so the caller can name the first bad
 * one. Without ``blocks``: always the ids. */
static int resolve(PyObject *blocks, const uint8_t *p, const uint8_t *end, uint32_t field, Py_ssize_t count, PyObject **found,
                   PyObject **ids) {
    PyObject *names = PyList_New(count);
    if (names == NULL) return -1;
    if (collect_strings(p, end, field, names, 0)) {
        Py_DECREF(names);
        return -1;
    }
    if (blocks != NULL && count > 0) {
        PyObject *out = PyList_New(count);
        if (out == NULL) {
            Py_DECREF(names);
            return -1;
        }
        Py_ssize_t i;
        for (i = 0; i < count; i++) {
            PyObject *block = PyDict_GetItemWithError(blocks, PyList_GET_ITEM(names, i));
            if (block == NULL) break;
            Py_INCREF(block);
            PyList_SET_ITEM(out, i, block);
        }
        if (i == count) {
            Py_DECREF(names);
            *found = out;
            *ids = Py_NewRef(Py_None);
            return 0;
        }
        Py_DECREF(out);
        if (PyErr_Occurred()) {
            Py_DECREF(names);
            return -1;
        }
    }
    *found = Py_NewRef(Py_None);
    *ids = names;
    return 0;
}

/* ---- events ------------------------------------------------------------------------------- */

static PyObject *allocated(PyObject *kind, PyObject *ts, const slot_t *msg) {
    slot_t a[5], in[MAX_FIELD + 1];
    fill(&M_ALLOCATED, msg->s, msg->s + msg->n, a);
    if (a[1].present) {
        fill(&M_INTENT, a[1].s, a[1].s + a[1].n, in);
    } else {
        memset(in, 0, sizeof in);
    }
    PyObject *allowed = PyTuple_New(in[18].n);
    if (allowed != NULL && in[18].n && collect_strings(a[1].s, a[1].s + a[1].n, 18, allowed, 1)) Py_CLEAR(allowed);
    PyObject *items[] = {
        kind,
        ts,
        str_of(&a[2]),           /* tier */
        bool_of(&a[3]),          /* reuse */
        id_of(&in[1]),           /* block_id */
        str_of(&in[2]),          /* request_id */
        enum_of(&in[3]),         /* phase */
        enum_of(&in[4]),         /* priority */
        opt(i64_of, &in[5]),     /* deadline_us */
        opt(i64_of, &in[6]),     /* slack_us */
        opt(i64_of, &in[7]),     /* recompute_cost_us */
        opt(i64_of, &in[8]),     /* spill_cost_us */
        u64_of(&in[9]),          /* size_bytes */
        bool_of(&in[10]),        /* pin_requested */
        bool_of(&in[11]),        /* is_draft */
        bool_of(&in[12]),        /* is_committed */
        str_of(&in[13]),         /* tenant */
        u32_of(&in[14]),         /* layer */
        u32_of(&in[15]),         /* head_group */
        u64_of(&in[16]),         /* token_start */
        u32_of(&in[17]),         /* token_count */
        allowed,                 /* allowed_tiers */
        id_of(&in[19]),          /* parent_block_id */
        opt(u32_of, &in[20]),    /* request_priority */
        opt(u32_of, &in[21]),    /* expected_reuse_window_tokens */
        bool_of(&in[22]),        /* recompute_ok */
        bool_of(&in[23]),        /* compression_ok */
        bool_of(&in[24]),        /* prefetch_ok */
        str_of(&a[4]),           /* scope (of BlockAllocated) */
    };
    return pack(sizeof items / sizeof items[0], items);
}

/* A packed repeated uint64 (already scanned) as a list of ints. */
static PyObject *u64_list(const slot_t *slot) {
    PyObject *out = PyList_New(0);
    if (out == NULL || !slot->present) return out;
    const uint8_t *p = slot->s, *end = slot->s + slot->n;
    uint64_t v;
    while (p < end && !read_varint(&p, end, &v)) {
        PyObject *x = PyLong_FromUnsignedLongLong(v);
        if (x == NULL || PyList_Append(out, x)) {
            Py_XDECREF(x);
            Py_DECREF(out);
            return NULL;
        }
        Py_DECREF(x);
    }
    return out;
}

static PyObject *accessed(PyObject *kind, PyObject *ts, const slot_t *msg, PyObject *blocks) {
    slot_t a[7];
    fill(&M_ACCESSED, msg->s, msg->s + msg->n, a);
    PyObject *found = NULL, *ids = NULL;
    if (resolve(blocks, msg->s, msg->s + msg->n, 1, a[1].n, &found, &ids)) {
        Py_DECREF(kind);
        Py_DECREF(ts);
        return NULL;
    }
    PyObject *items[] = {kind, ts, opt(i64_of, &a[2]), found, ids, str_of(&a[3]), u64_list(&a[4]), str_of(&a[5]), bool_of(&a[6])};
    return pack(9, items);
}

static PyObject *named_blocks(PyObject *kind, PyObject *ts, const slot_t *msg, const msgdef *m, PyObject *blocks) {
    slot_t a[2];
    fill(m, msg->s, msg->s + msg->n, a);
    PyObject *found = NULL, *ids = NULL;
    if (resolve(blocks, msg->s, msg->s + msg->n, 1, a[1].n, &found, &ids)) {
        Py_DECREF(kind);
        Py_DECREF(ts);
        return NULL;
    }
    PyObject *items[] = {kind, ts, found, ids};
    return pack(4, items);
}

static PyObject *updated(PyObject *kind, PyObject *ts, const slot_t *msg) {
    slot_t u[13];
    fill(&M_UPDATED, msg->s, msg->s + msg->n, u);
    PyObject *items[] = {
        kind,
        ts,
        id_of(&u[1]),           /* block_id */
        opt(enum_of, &u[2]),    /* phase */
        opt(enum_of, &u[3]),    /* priority */
        opt(i64_of, &u[4]),     /* deadline_us */
        opt(i64_of, &u[5]),     /* slack_us */
        opt(bool_of, &u[6]),    /* pin_requested */
        opt(bool_of, &u[7]),    /* is_committed */
        opt(bool_of, &u[8]),    /* is_draft */
        opt(i64_of, &u[9]),     /* recompute_cost_us */
        bool_of(&u[10]),        /* clear_deadline */
        opt(u32_of, &u[11]),    /* expected_reuse_window_tokens */
        opt(u32_of, &u[12]),    /* request_priority */
    };
    return pack(sizeof items / sizeof items[0], items);
}

static PyObject *acked(PyObject *kind, PyObject *ts, const slot_t *msg) {
    slot_t k[5];
    fill(&M_ACKED, msg->s, msg->s + msg->n, k);
    PyObject *items[] = {kind, ts, u64_of(&k[1]), enum_of(&k[2]), str_of(&k[3])};
    return pack(5, items);
}

static PyObject *eviction(PyObject *kind, PyObject *ts, const slot_t *msg) {
    slot_t e[4];
    fill(&M_EVICTION, msg->s, msg->s + msg->n, e);
    PyObject *ids = PyList_New(e[3].n);
    if (ids != NULL && e[3].n && collect_strings(msg->s, msg->s + msg->n, 3, ids, 0)) Py_CLEAR(ids);
    PyObject *items[] = {kind, ts, str_of(&e[1]), u32_of(&e[2]), ids};
    return pack(5, items);
}

/* One event's tuple (layouts in broker/model/wire.py). */
static PyObject *event_tuple(const uint8_t *p, const uint8_t *end, PyObject *blocks) {
    slot_t ev[10];
    fill(&M_EVENT, p, end, ev);
    int k = 0;
    for (int i = M_EVENT.oneof_lo; i <= M_EVENT.oneof_hi; i++) {
        if (ev[i].present) k = i;
    }
    PyObject *ts = i64_of(&ev[1]);
    if (ts == NULL) return NULL;
    PyObject *kind = PyLong_FromLong(k);
    if (kind == NULL) {
        Py_DECREF(ts);
        return NULL;
    }
    switch (k) {
        case 2:
            return allocated(kind, ts, &ev[2]);
        case 3:
            return accessed(kind, ts, &ev[3], blocks);
        case 4:
            return updated(kind, ts, &ev[4]);
        case 5:
        case 6:
            return named_blocks(kind, ts, &ev[k], &M_IDS, blocks);
        case 8:
            return acked(kind, ts, &ev[8]);
        case 9:
            return eviction(kind, ts, &ev[9]);
        default: { /* 0: no kind set; 7: cleared */
            PyObject *items[] = {kind, ts};
            return pack(2, items);
        }
    }
}

/* ---- the reader ---------------------------------------------------------------------------- */

/* A scanned batch: its header and where each event lies in ``raw``. Reading the events
 * (``events(blocks)``) makes an EventIter; a batch applied to several cores (shadow
 * policies, replay of many policies) is scanned once and read once per core. */
typedef struct {
    PyObject_HEAD
    PyObject *raw;       /* bytes: owns the buffer the spans point into */
    PyObject *client_id; /* str */
    PyObject *tenant;    /* str */
    PyObject *batch_seq; /* int */
    PyObject *received_us; /* int */
    Py_ssize_t count;    /* events */
    Py_ssize_t *spans;   /* start and length of each event, in raw */
} Reader;

typedef struct {
    PyObject_HEAD
    Reader *reader;
    PyObject *blocks; /* dict of the core's blocks, or NULL */
    Py_ssize_t next;
} EventIter;

static PyTypeObject ReaderType;
static PyTypeObject EventIterType;

static void reader_dealloc(Reader *self) {
    Py_XDECREF(self->raw);
    Py_XDECREF(self->client_id);
    Py_XDECREF(self->tenant);
    Py_XDECREF(self->batch_seq);
    Py_XDECREF(self->received_us);
    PyMem_Free(self->spans);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static int unsupported(void) {
    PyErr_SetString(Unsupported, "this encoding needs the reference reader");
    return -1;
}

/* Scan the whole batch (nothing is applied before it is known to be readable). */
static int reader_scan(Reader *self) {
    const uint8_t *base = (const uint8_t *)PyBytes_AS_STRING(self->raw);
    const uint8_t *p = base, *end = base + PyBytes_GET_SIZE(self->raw);
    slot_t top[6];
    memset(top, 0, sizeof top);
    Py_ssize_t cap = 0;
    while (p < end) {
        uint32_t num;
        int wire;
        if (read_key(&p, end, &num, &wire)) return unsupported();
        if (num == 3) {
            Py_ssize_t n;
            if (wire != 2 || read_len(&p, end, &n) || scan_msg(&M_EVENT, p, p + n)) return unsupported();
            if (self->count == cap) {
                cap = cap ? 2 * cap : 64;
                Py_ssize_t *grown = PyMem_Realloc(self->spans, sizeof(Py_ssize_t) * 2 * (size_t)cap);
                if (grown == NULL) {
                    PyErr_NoMemory();
                    return -1;
                }
                self->spans = grown;
            }
            self->spans[2 * self->count] = p - base;
            self->spans[2 * self->count + 1] = n;
            self->count++;
            p += n;
            continue;
        }
        int type = num <= (uint32_t)M_BATCH.max ? M_BATCH.type[num] : F_NONE;
        if (type == F_NONE) {
            if (skip_value(wire, &p, end)) return unsupported();
            continue;
        }
        if (top[num].present) return unsupported();
        top[num].present = 1;
        if (type == F_VARINT) {
            if (wire != 0 || read_varint(&p, end, &top[num].v)) return unsupported();
        } else {
            Py_ssize_t n;
            if (wire != 2 || read_len(&p, end, &n) || !utf8_ok(p, n)) return unsupported();
            top[num].s = p;
            top[num].n = n;
            p += n;
        }
    }
    self->client_id = str_of(&top[1]);
    self->batch_seq = u64_of(&top[2]);
    self->tenant = str_of(&top[4]);
    self->received_us = u64_of(&top[5]);
    if (self->client_id == NULL || self->batch_seq == NULL || self->tenant == NULL || self->received_us == NULL) return -1;
    return 0;
}

static PyObject *reader_new(PyTypeObject *type, PyObject *args, PyObject *kwds) {
    static char *names[] = {"raw", NULL};
    PyObject *raw;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "O!:BatchReader", names, &PyBytes_Type, &raw)) return NULL;
    Reader *self = (Reader *)type->tp_alloc(type, 0);
    if (self == NULL) return NULL;
    self->raw = Py_NewRef(raw);
    if (reader_scan(self)) {
        Py_DECREF(self);
        return NULL;
    }
    return (PyObject *)self;
}

static PyObject *reader_events(Reader *self, PyObject *args) {
    PyObject *blocks = Py_None;
    if (!PyArg_ParseTuple(args, "|O:events", &blocks)) return NULL;
    if (blocks != Py_None && !PyDict_CheckExact(blocks)) {
        PyErr_SetString(PyExc_TypeError, "BatchReader.events: blocks must be a dict or None");
        return NULL;
    }
    EventIter *it = PyObject_New(EventIter, &EventIterType);
    if (it == NULL) return NULL;
    it->reader = (Reader *)Py_NewRef(self);
    it->blocks = blocks == Py_None ? NULL : Py_NewRef(blocks);
    it->next = 0;
    return (PyObject *)it;
}

static void iter_dealloc(EventIter *self) {
    Py_XDECREF(self->reader);
    Py_XDECREF(self->blocks);
    PyObject_Free(self);
}

static PyObject *iter_next(EventIter *self) {
    Reader *r = self->reader;
    if (self->next >= r->count) return NULL; /* StopIteration */
    Py_ssize_t i = self->next++;
    const uint8_t *p = (const uint8_t *)PyBytes_AS_STRING(r->raw) + r->spans[2 * i];
    return event_tuple(p, p + r->spans[2 * i + 1], self->blocks);
}

static PyMethodDef reader_methods[] = {
    {"events", (PyCFunction)reader_events, METH_VARARGS,
     "events(blocks=None): an iterator over the events as tuples, block ids looked up in blocks as each is read"},
    {NULL},
};

static PyMemberDef reader_members[] = {
    {"client_id", T_OBJECT_EX, offsetof(Reader, client_id), READONLY, "IntentBatch.client_id"},
    {"batch_seq", T_OBJECT_EX, offsetof(Reader, batch_seq), READONLY, "IntentBatch.batch_seq"},
    {"tenant", T_OBJECT_EX, offsetof(Reader, tenant), READONLY, "IntentBatch.tenant"},
    {"received_us", T_OBJECT_EX, offsetof(Reader, received_us), READONLY, "IntentBatch.broker_received_us"},
    {"count", T_PYSSIZET, offsetof(Reader, count), READONLY, "number of events"},
    {"raw", T_OBJECT_EX, offsetof(Reader, raw), READONLY, "the serialized IntentBatch"},
    {NULL},
};

static PyTypeObject ReaderType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "broker.model._wire.BatchReader",
    .tp_basicsize = sizeof(Reader),
    .tp_dealloc = (destructor)reader_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "BatchReader(raw: bytes)\n\n"
              "One serialized IntentBatch, scanned: its header, and its events as tuples (broker/model/wire.py)\n"
              "through events(blocks); raises Unsupported for an encoding only the reference reader takes.",
    .tp_methods = reader_methods,
    .tp_members = reader_members,
    .tp_new = reader_new,
};

static PyTypeObject EventIterType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "broker.model._wire.EventIter",
    .tp_basicsize = sizeof(EventIter),
    .tp_dealloc = (destructor)iter_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "The events of a BatchReader, read one at a time.",
    .tp_iter = PyObject_SelfIter,
    .tp_iternext = (iternextfunc)iter_next,
};

static struct PyModuleDef wire_module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "broker.model._wire",
    .m_doc = "Native reader of kvbroker.v1.IntentBatch wire bytes (see broker/model/wire.py).",
    .m_size = -1,
};

PyMODINIT_FUNC PyInit__wire(void) {
    if (PyType_Ready(&ReaderType) < 0 || PyType_Ready(&EventIterType) < 0) return NULL;
    PyObject *m = PyModule_Create(&wire_module);
    if (m == NULL) return NULL;
    Unsupported = PyErr_NewExceptionWithDoc("broker.model._wire.Unsupported", "An encoding only the reference reader takes.",
                                            PyExc_ValueError, NULL);
    if (Unsupported == NULL || PyModule_AddObjectRef(m, "Unsupported", Unsupported) < 0 ||
        PyModule_AddObjectRef(m, "BatchReader", (PyObject *)&ReaderType) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
