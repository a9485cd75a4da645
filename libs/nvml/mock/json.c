/* See json.h. Recursive descent over UTF-8 text; depth is bounded so a hostile file cannot
 * exhaust the stack. */
#include "json.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define MAX_DEPTH 64

typedef struct {
    const char *p, *end;
    int depth;
} parser;

static jv *jnew(jtype t) {
    jv *v = calloc(1, sizeof *v);
    if (v) v->t = t;
    return v;
}

void json_free(jv *v) {
    if (!v) return;
    for (size_t i = 0; i < v->n; i++) {
        json_free(v->items[i]);
        if (v->keys) free(v->keys[i]);
    }
    free(v->items);
    free(v->keys);
    free(v->s);
    free(v);
}

static void skip_ws(parser *ps) {
    while (ps->p < ps->end && (*ps->p == ' ' || *ps->p == '\n' || *ps->p == '\r' || *ps->p == '\t'))
        ps->p++;
}

static int grow(jv *v) {
    if (v->n < v->cap) return 0;
    size_t cap = v->cap ? v->cap * 2 : 8;
    jv **items = realloc(v->items, cap * sizeof *items);
    if (!items) return -1;
    v->items = items;
    if (v->t == J_OBJ) {
        char **keys = realloc(v->keys, cap * sizeof *keys);
        if (!keys) return -1;
        v->keys = keys;
    }
    v->cap = cap;
    return 0;
}

static int put_utf8(char *out, unsigned cp) {
    if (cp < 0x80) { out[0] = (char)cp; return 1; }
    if (cp < 0x800) { out[0] = (char)(0xC0 | cp >> 6); out[1] = (char)(0x80 | (cp & 0x3F)); return 2; }
    if (cp < 0x10000) {
        out[0] = (char)(0xE0 | cp >> 12); out[1] = (char)(0x80 | ((cp >> 6) & 0x3F));
        out[2] = (char)(0x80 | (cp & 0x3F)); return 3;
    }
    out[0] = (char)(0xF0 | cp >> 18); out[1] = (char)(0x80 | ((cp >> 12) & 0x3F));
    out[2] = (char)(0x80 | ((cp >> 6) & 0x3F)); out[3] = (char)(0x80 | (cp & 0x3F));
    return 4;
}

static int hex4(const char *p, unsigned *out) {
    unsigned v = 0;
    for (int i = 0; i < 4; i++) {
        char c = p[i];
        v <<= 4;
        if (c >= '0' && c <= '9') v |= (unsigned)(c - '0');
        else if (c >= 'a' && c <= 'f') v |= (unsigned)(c - 'a' + 10);
        else if (c >= 'A' && c <= 'F') v |= (unsigned)(c - 'A' + 10);
        else return -1;
    }
    *out = v;
    return 0;
}

/* A string token at ps->p (on the opening quote); malloc'd, decoded. */
static char *parse_string(parser *ps) {
    ps->p++;
    const char *start = ps->p;
    size_t max = 0;
    while (ps->p < ps->end && *ps->p != '"') {
        if (*ps->p == '\\') ps->p++;
        ps->p++;
        max++;
    }
    if (ps->p >= ps->end) return NULL;
    const char *stop = ps->p++;
    char *out = malloc(max * 4 + 1), *o = out;
    if (!out) return NULL;
    for (const char *q = start; q < stop; q++) {
        if (*q != '\\') { *o++ = *q; continue; }
        q++;
        switch (*q) {
        case 'n': *o++ = '\n'; break;
        case 't': *o++ = '\t'; break;
        case 'r': *o++ = '\r'; break;
        case 'b': *o++ = '\b'; break;
        case 'f': *o++ = '\f'; break;
        case 'u': {
            unsigned cp, lo;
            if (stop - q < 5 || hex4(q + 1, &cp)) { free(out); return NULL; }
            q += 4;
            if (cp >= 0xD800 && cp < 0xDC00 && stop - q >= 7 && q[1] == '\\' && q[2] == 'u' &&
                !hex4(q + 3, &lo) && lo >= 0xDC00 && lo < 0xE000) {
                cp = 0x10000 + ((cp - 0xD800) << 10) + (lo - 0xDC00);
                q += 6;
            }
            o += put_utf8(o, cp);
            break;
        }
        default: *o++ = *q; break; /* \" \\ \/ */
        }
    }
    *o = 0;
    return out;
}

static jv *parse_value(parser *ps);

static jv *parse_container(parser *ps, jtype t) {
    char close = t == J_ARR ? ']' : '}';
    jv *v = jnew(t);
    if (!v || ++ps->depth > MAX_DEPTH) goto fail;
    ps->p++;
    skip_ws(ps);
    if (ps->p < ps->end && *ps->p == close) { ps->p++; ps->depth--; return v; }
    for (;;) {
        char *key = NULL;
        skip_ws(ps);
        if (t == J_OBJ) {
            if (ps->p >= ps->end || *ps->p != '"' || !(key = parse_string(ps))) goto fail;
            skip_ws(ps);
            if (ps->p >= ps->end || *ps->p != ':') { free(key); goto fail; }
            ps->p++;
        }
        jv *item = parse_value(ps);
        if (!item || grow(v)) { free(key); json_free(item); goto fail; }
        if (t == J_OBJ) v->keys[v->n] = key;
        v->items[v->n++] = item;
        skip_ws(ps);
        if (ps->p < ps->end && *ps->p == ',') { ps->p++; continue; }
        if (ps->p < ps->end && *ps->p == close) { ps->p++; ps->depth--; return v; }
        goto fail;
    }
fail:
    json_free(v);
    return NULL;
}

static jv *parse_value(parser *ps) {
    skip_ws(ps);
    if (ps->p >= ps->end) return NULL;
    char c = *ps->p;
    if (c == '{') return parse_container(ps, J_OBJ);
    if (c == '[') return parse_container(ps, J_ARR);
    if (c == '"') {
        char *s = parse_string(ps);
        jv *v = s ? jnew(J_STR) : NULL;
        if (!v) { free(s); return NULL; }
        v->s = s;
        return v;
    }
    static const struct { const char *word; jtype t; int b; } words[] = {
        {"true", J_BOOL, 1}, {"false", J_BOOL, 0}, {"null", J_NULL, 0}};
    for (size_t i = 0; i < 3; i++) {
        size_t n = strlen(words[i].word);
        if ((size_t)(ps->end - ps->p) >= n && !memcmp(ps->p, words[i].word, n)) {
            ps->p += n;
            jv *v = jnew(words[i].t);
            if (v) v->b = words[i].b;
            return v;
        }
    }
    const char *start = ps->p;
    while (ps->p < ps->end && *ps->p && strchr("+-0123456789.eE", *ps->p)) ps->p++;
    if (ps->p == start) return NULL;
    jv *v = jnew(J_NUM);
    if (!v || !(v->s = strndup(start, (size_t)(ps->p - start)))) { free(v); return NULL; }
    return v;
}

jv *json_parse(const char *text, size_t len) {
    parser ps = {text, text + len, 0};
    jv *v = parse_value(&ps);
    skip_ws(&ps);
    if (v && ps.p != ps.end) { json_free(v); return NULL; }
    return v;
}

typedef struct {
    char *buf;
    size_t len, cap;
    int oom;
} sbuf;

static void put(sbuf *b, const char *s, size_t n) {
    if (b->oom) return;
    if (b->len + n + 1 > b->cap) {
        size_t cap = (b->cap ? b->cap : 4096);
        while (cap < b->len + n + 1) cap *= 2;
        char *buf = realloc(b->buf, cap);
        if (!buf) { b->oom = 1; return; }
        b->buf = buf;
        b->cap = cap;
    }
    memcpy(b->buf + b->len, s, n);
    b->len += n;
    b->buf[b->len] = 0;
}

static void put_string(sbuf *b, const char *s) {
    put(b, "\"", 1);
    for (const unsigned char *p = (const unsigned char *)s; *p; p++) {
        char esc[8];
        if (*p == '"' || *p == '\\') { esc[0] = '\\'; esc[1] = (char)*p; put(b, esc, 2); }
        else if (*p < 0x20) { snprintf(esc, sizeof esc, "\\u%04x", *p); put(b, esc, 6); }
        else put(b, (const char *)p, 1);
    }
    put(b, "\"", 1);
}

static void dump(sbuf *b, const jv *v) {
    switch (v->t) {
    case J_NULL: put(b, "null", 4); break;
    case J_BOOL: v->b ? put(b, "true", 4) : put(b, "false", 5); break;
    case J_NUM: put(b, v->s, strlen(v->s)); break;
    case J_STR: put_string(b, v->s); break;
    case J_ARR:
    case J_OBJ:
        put(b, v->t == J_ARR ? "[" : "{", 1);
        for (size_t i = 0; i < v->n; i++) {
            if (i) put(b, ",", 1);
            if (v->t == J_OBJ) { put_string(b, v->keys[i]); put(b, ":", 1); }
            dump(b, v->items[i]);
        }
        put(b, v->t == J_ARR ? "]" : "}", 1);
        break;
    }
}

char *json_dump(const jv *v) {
    sbuf b = {0};
    dump(&b, v);
    if (b.oom) { free(b.buf); return NULL; }
    return b.buf;
}

jv *jget(const jv *obj, const char *key) {
    if (!obj || obj->t != J_OBJ) return NULL;
    for (size_t i = 0; i < obj->n; i++)
        if (!strcmp(obj->keys[i], key)) return obj->items[i];
    return NULL;
}

jv *jat(const jv *arr, size_t i) {
    return arr && (arr->t == J_ARR || arr->t == J_OBJ) && i < arr->n ? arr->items[i] : NULL;
}

size_t jlen(const jv *arr) { return arr && arr->t == J_ARR ? arr->n : 0; }

long long jint(const jv *v, long long dflt) {
    if (!v || v->t != J_NUM) return dflt;
    return strtoll(v->s, NULL, 10);
}

int jbool(const jv *v, int dflt) { return v && v->t == J_BOOL ? v->b : dflt; }

const char *jstr(const jv *v, const char *dflt) { return v && v->t == J_STR ? v->s : dflt; }

jv *jnew_int(long long value) {
    char text[32];
    snprintf(text, sizeof text, "%lld", value);
    jv *v = jnew(J_NUM);
    if (v && !(v->s = strdup(text))) { free(v); return NULL; }
    return v;
}

jv *jnew_str(const char *value) {
    jv *v = jnew(J_STR);
    if (v && !(v->s = strdup(value))) { free(v); return NULL; }
    return v;
}

jv *jnew_bool(int value) {
    jv *v = jnew(J_BOOL);
    if (v) v->b = !!value;
    return v;
}

jv *jnew_null(void) { return jnew(J_NULL); }
jv *jnew_arr(void) { return jnew(J_ARR); }
jv *jnew_obj(void) { return jnew(J_OBJ); }

int jset(jv *obj, const char *key, jv *value) {
    if (!obj || obj->t != J_OBJ || !value) { json_free(value); return -1; }
    for (size_t i = 0; i < obj->n; i++) {
        if (!strcmp(obj->keys[i], key)) {
            json_free(obj->items[i]);
            obj->items[i] = value;
            return 0;
        }
    }
    char *k = strdup(key);
    if (!k || grow(obj)) { free(k); json_free(value); return -1; }
    obj->keys[obj->n] = k;
    obj->items[obj->n++] = value;
    return 0;
}

int jinsert(jv *arr, size_t at, jv *value) {
    if (!arr || arr->t != J_ARR || !value || grow(arr)) { json_free(value); return -1; }
    if (at > arr->n) at = arr->n;
    memmove(arr->items + at + 1, arr->items + at, (arr->n - at) * sizeof *arr->items);
    arr->items[at] = value;
    arr->n++;
    return 0;
}

int jpush(jv *arr, jv *value) { return jinsert(arr, arr ? arr->n : 0, value); }

void jremove(jv *arr, size_t i) {
    if (!arr || i >= arr->n) return;
    json_free(arr->items[i]);
    if (arr->keys) free(arr->keys[i]);
    memmove(arr->items + i, arr->items + i + 1, (arr->n - i - 1) * sizeof *arr->items);
    if (arr->keys) memmove(arr->keys + i, arr->keys + i + 1, (arr->n - i - 1) * sizeof *arr->keys);
    arr->n--;
}

jv *jcopy(const jv *v) {
    char *text = json_dump(v);
    jv *copy = text ? json_parse(text, strlen(text)) : NULL;
    free(text);
    return copy;
}
