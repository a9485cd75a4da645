/* A small JSON tree: enough to read the node file and to read, change and write back the fake
 * node's state file without losing a key. Numbers keep their source text, so a float the
 * Python side wrote ("time": 1764201.5) is written back byte for byte. Not thread safe on its
 * own: the library holds its lock around every use. */
#ifndef GPUSLICE_MOCK_JSON_H
#define GPUSLICE_MOCK_JSON_H

#include <stddef.h>

typedef enum { J_NULL, J_BOOL, J_NUM, J_STR, J_ARR, J_OBJ } jtype;

typedef struct jv {
    jtype t;
    int b;             /* J_BOOL */
    char *s;           /* J_STR: the decoded text; J_NUM: the number as written */
    struct jv **items; /* J_ARR, J_OBJ: the values */
    char **keys;       /* J_OBJ: the keys, parallel to items */
    size_t n, cap;
} jv;

jv *json_parse(const char *text, size_t len); /* NULL on a syntax error */
char *json_dump(const jv *v);                 /* malloc'd, compact; NULL when out of memory */
void json_free(jv *v);

jv *jget(const jv *obj, const char *key);     /* NULL when absent or obj is not an object */
jv *jat(const jv *arr, size_t i);             /* NULL past the end */
size_t jlen(const jv *arr);
long long jint(const jv *v, long long dflt);  /* dflt for null, absent or non-numbers */
int jbool(const jv *v, int dflt);
const char *jstr(const jv *v, const char *dflt);

jv *jnew_int(long long value);
jv *jnew_str(const char *value);
jv *jnew_bool(int value);
jv *jnew_null(void);
jv *jnew_arr(void);
jv *jnew_obj(void);
int jset(jv *obj, const char *key, jv *value);     /* replaces; takes ownership; -1 on OOM */
int jpush(jv *arr, jv *value);                     /* takes ownership; -1 on OOM */
int jinsert(jv *arr, size_t at, jv *value);        /* takes ownership; -1 on OOM */
void jremove(jv *arr, size_t i);                   /* frees the removed value */
jv *jcopy(const jv *v);                            /* deep copy; NULL on OOM */

#endif
