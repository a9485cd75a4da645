package main

// The OCI state on stdin, and the few Python spellings the hook's messages use (repr of a
// value, float() of a number), so that both hooks word every refusal the same way.

import (
	"bytes"
	"encoding/json"
	"errors"
	"math"
	"strconv"
	"strings"
	"unicode"
	"unicode/utf8"
)

// readState returns the container id and pid of the OCI state JSON.
func readState(data []byte) (string, int64, error) {
	var state map[string]json.RawMessage
	if err := json.Unmarshal(data, &state); err != nil {
		var syntax *json.SyntaxError
		if errors.As(err, &syntax) || !json.Valid(data) {
			return "", 0, errors.New("the OCI state is not JSON: " + err.Error())
		}
		return "", 0, errors.New("the OCI state is not a JSON object")
	}
	if state == nil { // the JSON null
		return "", 0, errors.New("the OCI state is not a JSON object")
	}
	var containerID string
	if raw, ok := state["id"]; !ok || json.Unmarshal(raw, &containerID) != nil || containerID == "" {
		return "", 0, errors.New("the OCI state has no container id")
	}
	raw, ok := state["pid"]
	if !ok {
		return containerID, 0, nil
	}
	pid, err := strconv.ParseInt(string(raw), 10, 64) // a JSON integer, and only that
	if err != nil || pid < 0 {
		return "", 0, errors.New("the OCI state has a bad pid " + pyRepr(raw))
	}
	return containerID, pid, nil
}

// pyRepr is Python's repr() of the value json.loads makes of raw (one valid JSON value).
func pyRepr(raw []byte) string {
	decoder := json.NewDecoder(bytes.NewReader(raw))
	decoder.UseNumber()
	var out strings.Builder
	reprValue(decoder, &out)
	return out.String()
}

func reprValue(decoder *json.Decoder, out *strings.Builder) {
	token, err := decoder.Token()
	if err != nil {
		return
	}
	switch t := token.(type) {
	case json.Delim:
		closing := "]"
		if t == '{' {
			closing = "}"
		}
		out.WriteString(t.String())
		for i := 0; decoder.More(); i++ {
			if i > 0 {
				out.WriteString(", ")
			}
			if t == '{' {
				key, _ := decoder.Token()
				name, _ := key.(string)
				out.WriteString(pyStr(name) + ": ")
			}
			reprValue(decoder, out)
		}
		_, _ = decoder.Token()
		out.WriteString(closing)
	case bool:
		out.WriteString(map[bool]string{true: "True", false: "False"}[t])
	case nil:
		out.WriteString("None")
	case string:
		out.WriteString(pyStr(t))
	case json.Number:
		out.WriteString(pyNumber(string(t)))
	}
}

// pyNumber is repr() of a JSON number as Python reads it: an int, or a float when it has a
// fraction or an exponent.
func pyNumber(text string) string {
	if !strings.ContainsAny(text, ".eE") {
		if text == "-0" {
			return "0"
		}
		return text
	}
	f, _ := strconv.ParseFloat(text, 64) // out of range: ±Inf, as Python's float()
	return pyFloatRepr(f)
}

// pyFloatRepr is Python's repr() of a float: the shortest digits that read back the same,
// in fixed notation from 1e-4 up to 1e16 and with an exponent of at least two digits past it.
func pyFloatRepr(f float64) string {
	switch {
	case math.IsInf(f, 1):
		return "inf"
	case math.IsInf(f, -1):
		return "-inf"
	case math.IsNaN(f):
		return "nan"
	case f == 0 && math.Signbit(f):
		return "-0.0"
	case f == 0:
		return "0.0"
	}
	mantissa, exponent, _ := strings.Cut(strconv.FormatFloat(f, 'e', -1, 64), "e")
	sign := ""
	if strings.HasPrefix(mantissa, "-") {
		sign, mantissa = "-", mantissa[1:]
	}
	digits := strings.Replace(mantissa, ".", "", 1)
	exp, _ := strconv.Atoi(exponent)
	if exp < -4 || exp >= 16 {
		out := sign + digits[:1]
		if len(digits) > 1 {
			out += "." + digits[1:]
		}
		expSign := "+"
		if exp < 0 {
			expSign, exp = "-", -exp
		}
		expText := strconv.Itoa(exp)
		if len(expText) < 2 {
			expText = "0" + expText
		}
		return out + "e" + expSign + expText
	}
	if exp < 0 {
		return sign + "0." + strings.Repeat("0", -exp-1) + digits
	}
	if len(digits) <= exp+1 {
		return sign + digits + strings.Repeat("0", exp+1-len(digits)) + ".0"
	}
	return sign + digits[:exp+1] + "." + digits[exp+1:]
}

// pyStr is Python's repr() of a str. A byte that is not UTF-8 is shown as Python shows the
// surrogate its command line decodes it to (\udcXX).
func pyStr(text string) string {
	quote := byte('\'')
	if strings.Contains(text, "'") && !strings.Contains(text, "\"") {
		quote = '"'
	}
	out := []byte{quote}
	for i := 0; i < len(text); {
		r, size := utf8.DecodeRuneInString(text[i:])
		switch {
		case r == utf8.RuneError && size == 1:
			out = append(out, `\udc`...)
			out = strconv.AppendUint(out, uint64(text[i]), 16)
		case r == rune(quote) || r == '\\':
			out = append(out, '\\', byte(r))
		case r == '\t':
			out = append(out, `\t`...)
		case r == '\n':
			out = append(out, `\n`...)
		case r == '\r':
			out = append(out, `\r`...)
		case r < 0x20 || r == 0x7f || (r >= 0x80 && !unicode.IsPrint(r)):
			out = append(out, pyEscape(r)...)
		default:
			out = append(out, text[i:i+size]...)
		}
		i += size
	}
	return string(append(out, quote))
}

func pyEscape(r rune) string {
	hex := strconv.FormatInt(int64(r), 16)
	switch {
	case r < 0x100:
		return `\x` + strings.Repeat("0", 2-len(hex)) + hex
	case r < 0x10000:
		return `\u` + strings.Repeat("0", 4-len(hex)) + hex
	}
	return `\U` + strings.Repeat("0", 8-len(hex)) + hex
}

// pyFloat reads a number as Python's float() does: surrounding white space, an optional sign,
// decimal digits with single underscores between them, inf, infinity, nan; no hexadecimal.
func pyFloat(text string) (float64, bool) {
	text = strings.TrimSpace(text)
	if strings.ContainsAny(text, "xX") {
		return 0, false
	}
	if strings.Contains(text, "_") {
		for i := 0; i < len(text); i++ {
			if text[i] == '_' && (i == 0 || i == len(text)-1 ||
				!isDigit(text[i-1]) || !isDigit(text[i+1])) {
				return 0, false
			}
		}
		text = strings.ReplaceAll(text, "_", "")
	}
	f, err := strconv.ParseFloat(text, 64)
	if err != nil && !errors.Is(err, strconv.ErrRange) {
		return 0, false
	}
	return f, true
}

func isDigit(c byte) bool { return c >= '0' && c <= '9' }
